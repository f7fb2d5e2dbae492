"""The emitter of the rewrite (:mod:`.rewrite`): builds the per-rank graph while the walk
reads the old one, and gives the layout rules (:mod:`.rules`) their vocabulary.

    old node ──env──> new value      old node ──layouts──> Global | Sharded(dim, inner)
    em.to_sharded(x, d):  x (B, S, D) Global  ─ index_select(d, this rank's positions) ─> (B, c, D)
    em.to_global(x):      x (B, c, D) Sharded ─ gather_seq (all-gather + un-permute) ─> (B, S, D)
                          (merged dims: (B·c·k, D) ─ unflatten (B, c, k) ─ gather ─ flatten ─> (B·S·k, D))
    em.fallback(node):    gather the Sharded inputs, run node whole (warned), re-shard if shape-preserving

Kept apart from the walk so the rules can import it without importing the walk, which
imports the rules.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ... import graph_ops
from ..context import CPRewriteError, RewriteContext, log
from ..fx_utils import (  # noqa: F401 (erase_unused, mutates, drop_empty_vmap_regions: re-exported for the rules)
    drop_empty_vmap_regions, erase_unused, fake_value, global_shape, mutates, source_line)
from .placements import GLOBAL, Layout, Local, Sharded
from .seqindex import SeqIndex


class Emitter:
    """Builds the new graph; rules use it to read layouts and emit nodes."""

    def __init__(self, gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, torch.Tensor]) -> None:
        self.gm, self.ctx, self.examples = gm, ctx, examples
        self.graph = fx.Graph()
        self.env: Dict[fx.Node, Any] = {}  # old node -> new node (or python value)
        self.layouts: Dict[fx.Node, Any] = {}  # old node -> Layout, tuple of layouts, or None
        self._memo: Dict[Tuple[fx.Node, int, int], fx.Node] = {}
        self._consts: Dict[str, fx.Node] = {}
        self.index = SeqIndex(self)
        self.inputs: List[fx.Node] = []  # placeholders awaiting _finish_inputs
        self.row_numbers: Dict[fx.Node, str] = {}  # Sharded values holding row numbers of a selection (routing)
        self.vmap_depth = 0  # inside how many inlined torch.vmap regions the walk is (rules/vmap.py)

    # -- reading the old graph ------------------------------------------------
    def value(self, arg: Any) -> Any:
        """``arg`` with old nodes replaced by their new values (inside tuples, lists, dicts, slices)."""
        return fx.node.map_aggregate(arg, lambda a: self.env[a] if isinstance(a, fx.Node) else a)

    def layout(self, arg: Any) -> Optional[Layout]:
        return self.layouts.get(arg) if isinstance(arg, fx.Node) else None

    def sharded_inputs(self, node: fx.Node) -> bool:
        """Whether ``node`` reads a Sharded value, or a Local one (rows selected from this rank's tokens)."""
        flat, _ = tree_flatten((node.args, node.kwargs))
        return any(isinstance(self.layout(a), (Sharded, Local)) for a in flat)

    # -- emitting ---------------------------------------------------------------
    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_method(name, args, kwargs)

    def copy(self, node: fx.Node, args: Tuple, kwargs: Dict) -> fx.Node:
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        return new

    def const(self, name: str, tensor: torch.Tensor) -> fx.Node:
        if name not in self._consts:
            self.gm.register_buffer(name, tensor, persistent=False)
            self._consts[name] = self.graph.get_attr(name)
        return self._consts[name]

    def seq_node(self) -> fx.Node:
        """The new graph's value of a symbolic S (the SymInt placeholder Dynamo made for it)."""
        return self.env[self.seq_placeholder()]

    def seq_placeholder(self) -> fx.Node:
        return self.seq_placeholders()[0]

    def seq_placeholders(self) -> List[fx.Node]:
        """Every SymInt placeholder whose value is the symbolic S. There may be several: each
        sequence input dim marked dynamic (``torch._dynamo.mark_dynamic``) gets its own symbol and
        placeholder, and an op that broadcasts them together makes Dynamo replace one symbol by the
        other, leaving two placeholders of the same S (both read by the graph)."""
        sym = self.ctx.seq_sym
        found = [old for old in self.env if old.op == "placeholder"
                 and isinstance(old.meta.get("example_value"), torch.SymInt)
                 and old.meta["example_value"].node.expr == sym.node.expr]
        if found:
            return found
        raise CPRewriteError(
            f"cp_compile: the dynamic sequence length {sym} is not a graph input. "
            "Fix: torch.compile(model, backend='ring_cp', dynamic=False)."
        )

    def valid_mask(self, old: fx.Node, local: fx.Node, dim: int, inner: int,
                   window: Optional[Tuple[int, int]] = None) -> Optional[fx.Node]:
        """Bool mask broadcastable to ``local`` (old's sharded value): False at padding rows and, for a
        windowed value (``window``, else old's own layout's), at the rows outside its window; or None."""
        shape = global_shape(old)
        lay = self.layout(old)
        window = window or (lay.window if isinstance(lay, Sharded) else None)
        if window is None:
            return self.index.valid(local, len(shape), dim, inner, shape[dim])
        a, n = window  # windows exist under a static S only (rules/getitem.py): a constant (c,) mask
        pos = self.ctx.positions()
        mask = ((pos >= a) & (pos < a + n)).reshape([-1 if d == dim else 1 for d in range(len(shape))])
        return self.const(f"_cp_window_{a}_{n}_{dim}_{len(shape)}", mask)

    def to_sharded(self, old: fx.Node, dim: int, inner: int = 1,
                   window: Optional[Tuple[int, int]] = None, chunk: int = 1) -> fx.Node:
        """A Global value indexed by this rank's positions along ``dim`` (memoised). With a ``window``
        (a, n) (old has size n there, one entry per window index): position p reads entry p - a,
        clamped into [0, n) (the rows outside the window are don't-care). With ``chunk`` > 1 the dim
        has one entry per chunk of that many tokens: this rank's chunks are read."""
        key = (old, dim, inner) if window is None else (old, dim, inner, window)
        key = key if chunk == 1 else (*key, "chunk", chunk)
        if chunk > 1 and key not in self._memo:
            index = self.index.index(global_shape(old)[dim], inner, chunk)
            self._memo[key] = self.method("index_select", self.env[old], dim, index)
        if key not in self._memo:
            if window is not None:
                a, n = window
                idx = self.const(f"_cp_window_index_{a}_{n}", (self.ctx.positions() - a).clamp(0, n - 1))
                self._memo[key] = self.method("index_select", self.env[old], dim, idx)
                return self._memo[key]
            size = global_shape(old)[dim] if self.ctx.seq_sym is None else self.method("size", self.env[old], dim)
            self._memo[key] = self.method("index_select", self.env[old], dim, self.index.index(size, inner))
        return self._memo[key]

    def windowed(self, arg: Any) -> bool:
        """Whether ``arg`` is a windowed Sharded value (a slice of the sequence: rules/getitem.py)."""
        lay = self.layout(arg)
        return isinstance(lay, Sharded) and lay.window is not None

    def to_global(self, old: fx.Node) -> fx.Node:
        """A Sharded value gathered to the full sequence on every rank."""
        lay = self.layout(old)
        if not isinstance(lay, Sharded):
            return self.env[old]
        order, inverse = self.index.order_inverse(lay.chunk)  # inverse drops the padding positions
        if lay.window is not None:  # (B, c, D) -> gather (B, S, D) -> narrow to the window (B, n, D)
            key = ("to_global", old)  # once for all its consumers without a window-aware rule
            if key not in self._memo:
                whole = self.call(graph_ops.gather_seq, self.env[old], lay.dim, order, inverse, self.ctx.world,
                                  self.ctx.group.name)
                self._memo[key] = self.method("narrow", whole, lay.dim, *lay.window)
            return self._memo[key]
        outer = global_shape(old)[lay.dim] // (self.ctx.seq_len // lay.chunk * lay.inner)
        if lay.inner == 1 and outer == 1:
            return self.call(graph_ops.gather_seq, self.env[old], lay.dim, order, inverse, self.ctx.world,
                             self.ctx.group.name)
        # tokens merged with other dims (B·S rows, S·k): (outer, c, inner) -> gather the c dim -> (outer·S·inner)
        split = self.method("unflatten", self.env[old], lay.dim, (outer, -1, lay.inner))
        whole = self.call(graph_ops.gather_seq, split, lay.dim + 1, order, inverse, self.ctx.world,
                          self.ctx.group.name)
        return self.method("flatten", whole, lay.dim, lay.dim + 2)

    def fallback(self, node: fx.Node, why: str) -> Any:
        """Gather every Sharded input of ``node`` and run it on full sequences.

        A result shaped like a gathered input (``flip`` along the sequence, ``roll`` of a padded
        sequence, a conv or a scan under ``load_balance="striped"``) is sharded again at once,
        along that input's dim: the gather costs the one op that needs the whole sequence,
        not every op after it.
        Any other result stays Global."""
        sharded = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(self.layout(a), Sharded)]
        if self.vmap_depth:
            raise CPRewriteError(
                f"cp_compile: {why} (node {node.name}) at {source_line(node)}, inside torch.vmap: the sequence would "
                "be gathered, and a collective cannot run on vmapped values. Fix: move this op out of the "
                "vmapped function, or keep the vmap out of the compiled model.")
        wholes = {a: self.whole_input(a) for a in sharded}
        if any(w is None for w in wholes.values()) or _floating(node):
            self.ctx.fallback(node, why)
        else:  # integer work on inputs every rank holds whole (labels=input_ids padded): no gather
            log.info("cp_compile: %s (node %s) at %s runs on the whole input(s) %s every rank was passed",
                     why, node.name, source_line(node), ", ".join(a.name for a in sharded))
        gathered = {a: wholes[a] if wholes[a] is not None else self.to_global(a) for a in sharded}
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: gathered.get(a, self.env.get(a, a)) if isinstance(a, fx.Node) else a
        )
        new = self.copy(node, args, kwargs)
        if mutates(node) and node.args and node.args[0] in gathered:
            return self._written_whole(node, new, gathered[node.args[0]])
        if _data_dependent(node):  # a size found by data (x[mask]): never the gathered inputs' shape
            return new, GLOBAL
        dims = {self.layout(a).dim for a in sharded if global_shape(a) == global_shape(node)}
        windowed = any(self.windowed(a) for a in sharded)  # its length is not S: to_sharded cannot re-shard it
        chunks = {self.layout(a).chunk for a in sharded}
        if len(dims) == 1 and all(self.layout(a).inner == 1 for a in sharded) and not windowed and len(chunks) == 1:
            self.env[node] = new  # to_sharded reads the whole value from env
            (dim,), (chunk,) = dims, chunks
            return self.to_sharded(node, dim, chunk=chunk), Sharded(dim, chunk=chunk)
        return new, GLOBAL

    def whole_input(self, x: fx.Node) -> Optional[fx.Node]:
        """The whole value of sequence input ``x`` that every rank was passed (``inputs="full"``) and that
        needs no gradient (so it skips no gradient sync), as a node of the new graph; else None."""
        val = x.meta.get("example_value")
        if x.op != "placeholder" or self.ctx.options.inputs != "full" or not isinstance(val, torch.Tensor) \
                or val.requires_grad:
            return None
        return next(n for n in self.graph.nodes if n.op == "placeholder" and n.target == x.target)

    def _written_whole(self, node: fx.Node, new: fx.Node, whole: fx.Node) -> Any:
        """An in-place op run on the gathered copy of a Sharded destination (``mask.scatter_(1, idx, 1)``):
        from here on the destination is this rank's rows of that written copy, so later readers see the
        write. A destination that is a view of another value cannot be rebound (its base would miss
        the write): refused, naming the op."""
        dest = node.args[0]
        val = dest.meta.get("example_value")
        if isinstance(val, torch.Tensor) and val._base is not None:
            raise CPRewriteError(
                f"cp_compile: {node.target} at {source_line(node)} writes in place into a view of a sequence-"
                "sharded value and has no per-token rule, so it would run on a gathered copy and the write "
                "would not reach the value it views. Fix: write into a whole tensor (e.g. build it with "
                "torch.cat) or report this model pattern.")
        lay = self.layout(dest)
        self._memo.pop(("to_global", dest), None)  # (a window's gathered value: stale after the write)
        self.env[dest] = whole  # to_sharded reads the whole value from env
        self._memo.pop((dest, lay.dim, lay.inner) if lay.window is None else (dest, lay.dim, lay.inner, lay.window),
                       None)
        self.env[dest] = self.to_sharded(dest, lay.dim, lay.inner, lay.window)
        return new, GLOBAL


def _floating(node: fx.Node) -> bool:
    """Whether ``node`` returns a floating-point tensor (activations: a whole one costs memory)."""
    flat, _ = tree_flatten(fake_value(node))
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in flat)


def _data_dependent(node: fx.Node) -> bool:
    """Whether ``node``'s result has a size found by data (Dynamo's unbacked symbols: ``x[mask]``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    flat, _ = tree_flatten(fake_value(node))
    return any(isinstance(t, torch.Tensor) and free_unbacked_symbols(t.shape) for t in flat)
