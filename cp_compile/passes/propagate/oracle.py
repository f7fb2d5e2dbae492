"""The rule oracle: decide an op the rule table does not know from its ATen decomposition.

docs/design.md §8. Before :meth:`Emitter.fallback` gathers the sequence for
a node with no hand rule, :func:`decide` traces that node alone to ATen ops
(``make_fx`` on fake inputs of the node's global shapes) and propagates "which dim
is the sequence" through the ATen graph with DTensor's sharding propagation
(``torch.distributed.tensor``: a 1-D mesh of N built without a process group):

    before:  x (B, S/N, D) Sharded(1) ─ gather ─> torch.erf(x) (B, S, D) Global     (warning)
    after:   x (B, S/N, D) Sharded(1) ─────────> torch.erf(x) (B, S/N, D) Sharded(1)

An ATen op is per-token when the propagator keeps every Shard(d) input as given
(no redistribution); its output's Shard dim is where the sequence lands. DTensor's
strategies are size-agnostic, so "Shard(d) in, Shard(d) out" means each row along d
is computed from that row alone: true for this rank's zigzag rows as for a contiguous
chunk. A whole (Replicate) input of the node that the propagator wants as Shard(d)
(a per-position table meeting a sharded value) is allowed when it has size S along d:
it is indexed by this rank's positions (``em.to_sharded``), as the pointwise rule does.
A few ATen ops whose DTensor strategy is more conservative than needed (``flip`` over
other dims) have a one-line rule in :data:`.oracle_aten._EXTRA`; the ATen-level walk
itself lives in :mod:`.oracle_aten`.

If the whole decomposition is per-token, the *original* node is emitted on the local
values (not the ATen graph), with layout ``Sharded(out_dim)``; else :func:`decide`
returns None and the caller gathers. Verdicts are cached per (target, argument
structure, shapes, sharded dims), so repeated layers cost one trace. The oracle never
raises: any exception means "don't know" (logged at DEBUG), i.e. the fallback.

A value holding the sequence in chunks (``Sharded(d, chunk=C)``: dim d has S / C entries, this
rank's chunks in load-balanced order) is asked the same way with S / C as the length: a strategy
that keeps Shard(d) computes each entry from that entry alone, so it holds for any set of entries
in any order; the output is then in chunks of C too, and a whole per-chunk table is indexed by
this rank's chunks. Every Sharded input must be in the same chunks (or none in chunks).

The same question asked backwards, :func:`rows_from_inputs` ("which inputs carry the rows
of this output?"), lets :mod:`.row_select` move a row selection above a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..context import fake_value, global_shape, log
from .placements import Sharded
from ..op_vocab import writes_in_place
from .oracle_aten import hint as _hint
from .oracle_aten import propagate, trace

if TYPE_CHECKING:
    from .emitter import Emitter


@dataclass(frozen=True)
class Verdict:
    """A per-token node: its output layout(s), and which whole inputs to index by position."""

    out: Any  # Sharded, or a tuple of Sharded for a multi-output op
    index: Tuple[Tuple[int, int], ...]  # (flat argument position, dim) of whole inputs to shard
    chunk: int = 1  # tokens per entry of the sequence dims (whole inputs are indexed by chunk)


_CACHE: Dict[Any, Optional[Verdict]] = {}
STATS = {"traced": 0, "cached": 0, "per_token": 0}  # for tests and the compile-time report


def decide(em: "Emitter", node: fx.Node) -> Optional[Tuple[Any, Any]]:
    """``(new node, layout)`` when ``node`` is per-token along the sequence, else None (gather)."""
    try:
        key = _key(em, node)
        if key is None:
            return None
        if key in _CACHE:
            STATS["cached"] += 1
        else:
            STATS["traced"] += 1
            _CACHE[key] = _verdict(em, node)
        verdict = _CACHE[key]
        if verdict is None:
            return None
        STATS["per_token"] += 1
        return _emit(em, node, verdict)
    except Exception as e:  # the oracle only ever says "don't know"
        log.debug("cp_compile: rule oracle failed on %s (%s: %s)", node.name, type(e).__name__, e)
        return None


# ----------------------------------------------------------------------------- the question
def _leaves(node: fx.Node) -> Tuple[List[Any], Any]:
    return tree_flatten((node.args, node.kwargs))


def _seq_dims(em: "Emitter", node: fx.Node) -> Optional[List[Optional[int]]]:
    """Per flat argument: the sequence dim of a Sharded tensor, None otherwise; None if unsupported."""
    leaves, _ = _leaves(node)
    dims: List[Optional[int]] = []
    for a in leaves:
        lay = em.layout(a)
        if isinstance(lay, Sharded) and lay.inner != 1:
            return None  # sequence merged with another dim: the hand rules' business
        if isinstance(a, fx.Node) and not isinstance(lay, Sharded) and lay is not None \
                and not isinstance(fake_value(a), (torch.Tensor, int, float, bool, torch.SymInt)):
            return None  # a tuple-valued or opaque input
        dims.append(lay.dim if isinstance(lay, Sharded) else None)
    return dims


def _chunk(em: "Emitter", node: fx.Node) -> Optional[int]:
    """The tokens per entry of the Sharded inputs' sequence dims (1: tokens); None when they differ."""
    chunks = {lay.chunk for a in _leaves(node)[0] if isinstance(lay := em.layout(a), Sharded)}
    return chunks.pop() if len(chunks) == 1 else None


def _key(em: "Emitter", node: fx.Node) -> Optional[Any]:
    """The cache key: target, argument structure, shapes/dtypes, constants, sharded dims and chunks."""
    if node.op not in ("call_function", "call_method"):
        return None
    if _in_place(node) and not (node.args and isinstance(em.layout(node.args[0]), Sharded)):
        return None  # in place on a whole value: indexing it by position would update a copy, not the value
    dims, chunk = _seq_dims(em, node), _chunk(em, node)
    if dims is None or chunk is None:
        return None
    try:
        return (node.op, node.target, _structure(node, dims), em.ctx.world, em.ctx.seq_len, chunk)
    except TypeError:
        return None


def _structure(node: fx.Node, dims: Optional[List[Optional[int]]] = None) -> Any:
    """``node``'s argument structure for a cache key: tree spec, then per leaf its kind and
    shape/dtype/device (tensors, with the sequence dim from ``dims``) or value (constants)."""
    leaves, spec = _leaves(node)
    parts = []
    for i, a in enumerate(leaves):
        val = fake_value(a) if isinstance(a, fx.Node) else a
        if isinstance(val, torch.Tensor):
            parts.append(("T", global_shape(a), val.dtype, str(val.device), dims[i] if dims else None))
        elif isinstance(val, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            parts.append(("C", type(val).__name__, val))
        elif isinstance(val, torch.SymInt):
            parts.append(("C", "int", _hint(val)))
        else:
            raise TypeError(f"argument of type {type(val).__name__}")
    return str(spec), tuple(parts)


def _in_place(node: fx.Node) -> bool:
    """In place on a value the oracle might index by position (a copy would be written). Python's
    augmented operators (``x /= y``) are not: Dynamo rebinds ``x`` to their result."""
    return writes_in_place(node) and getattr(node.target, "__module__", None) != "_operator"


def _verdict(em: "Emitter", node: fx.Node) -> Optional[Verdict]:
    dims, chunk = _seq_dims(em, node), _chunk(em, node)
    S, G = em.ctx.seq_len, _token_len(em, node, chunk)
    if G is None:
        return None
    outer = G * chunk // S  # > 1: tokens flattened with outer dims, e.g. (B·S, D) rows (inner 1)
    traced = _aten_graph(node, tuple({S, em.ctx.padded_len, G, outer * em.ctx.padded_len}))
    if traced is None:
        return None
    graph, tensors, placeholders = traced
    seq = {p: dims[i] for p, i in zip(placeholders, tensors) if dims[i] is not None}
    whole = {p: i for p, i in zip(placeholders, tensors) if dims[i] is None}
    for _ in range(len(whole) + 1):  # each round may shard one more whole input, then re-runs
        out, want = propagate(graph, seq, em.ctx.world)
        if want is None:
            return _finish(out, graph, seq, whole, G, chunk)
        p, d = want
        if p not in whole or p in seq or tuple(p.meta["val"].shape)[d] != G:
            return None  # a whole value that is not a per-position table of the node's inputs
        seq[p] = d
    return None


def _token_len(em: "Emitter", node: fx.Node, chunk: int) -> Optional[int]:
    """The one global size of the Sharded inputs' token dims: S, or outer·S for tokens flattened
    with outer dims (inner 1: the rows of a (B·S, D) view), or S / C in chunks of C; None when
    they differ."""
    sizes = {global_shape(a)[lay.dim] for a in _leaves(node)[0] if isinstance(lay := em.layout(a), Sharded)}
    if len(sizes) != 1:
        return None
    size, S = sizes.pop(), em.ctx.seq_len
    if chunk > 1:
        return size if isinstance(S, int) and size * chunk == S else None
    return size if size % S == 0 else None


def _aten_graph(node: fx.Node, lengths: Tuple[int, ...]) -> Optional[Tuple[fx.GraphModule, List[int], List[fx.Node]]]:
    """``node`` alone as an ATen graph, the flat positions of its tensor arguments and the graph's
    placeholders for them; None when an int argument equals one of ``lengths`` (a length baked
    into the arguments would be wrong on the local values) or the node cannot be traced."""
    leaves, spec = _leaves(node)
    values = [_hint(fake_value(a)) if isinstance(a, fx.Node) else a for a in leaves]
    if any(type(v) is int and v in lengths for v in values):
        return None
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    graph = trace(node, values, spec, tensors)
    if graph is None:
        return None
    return graph, tensors, [n for n in graph.graph.nodes if n.op == "placeholder"]


def _finish(out: Any, graph: fx.GraphModule, seq: Dict[fx.Node, int], whole: Dict[fx.Node, int],
            S: int, chunk: int = 1) -> Optional[Verdict]:
    """The verdict from the output placements (every tensor output Shard(d) along a dim of the
    token length ``S``: the sequence length, or outer·S for flattened tokens, or the number of
    chunks, the outputs then in the same ``chunk``)."""
    from torch.distributed.tensor import Shard

    if out is None:
        return None
    out_node = next(n for n in graph.graph.nodes if n.op == "output")
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in tree_flatten(out_node.args[0])[0]]
    flat, _ = tree_flatten(out)
    if not flat or len(flat) != len(vals):
        return None
    layouts = []
    for pl, v in zip(flat, vals):
        if not isinstance(pl, Shard) or not isinstance(v, torch.Tensor) or v.shape[pl.dim] != S:
            return None
        layouts.append(Sharded(pl.dim, chunk=chunk))
    index = tuple((whole[p], d) for p, d in seq.items() if p in whole)
    single = not isinstance(out, (tuple, list))
    return Verdict(layouts[0] if single else tuple(layouts), index, chunk)


# ----------------------------------------------------------------------------- emitting
def _emit(em: "Emitter", node: fx.Node, verdict: Verdict) -> Tuple[fx.Node, Any]:
    """The original node on the local values; whole per-position inputs indexed by position."""
    leaves, spec = _leaves(node)
    index = dict(verdict.index)
    new = [em.to_sharded(a, index[i], chunk=verdict.chunk) if i in index
           else (em.env[a] if isinstance(a, fx.Node) else a) for i, a in enumerate(leaves)]
    args, kwargs = tree_unflatten(new, spec)
    return em.copy(node, tuple(args), dict(kwargs)), verdict.out


# ----------------------------------------------------------------------------- backwards (row selection)
def rows_from_inputs(node: fx.Node, out_dim: int, length: int, world: int) -> Optional[Dict[int, int]]:
    """Which inputs of ``node`` carry the rows of its output along ``out_dim`` (size ``length``).

    The backward question of :func:`decide`, asked by :mod:`.row_select` to move a row
    selection above ``node``: ``{flat argument position: dim}`` such that selecting those
    rows of these inputs and running ``node`` gives the selected rows of its output; None
    when ``node`` is not per-token along ``out_dim`` (or for any doubt). Cached like decide."""
    try:
        key = ("rows", node.op, node.target, _structure(node), out_dim, length, world)
        if key not in _CACHE:
            _CACHE[key] = _rows_verdict(node, out_dim, length, world)
        return _CACHE[key]
    except Exception as e:  # "don't know"
        log.debug("cp_compile: rule oracle (rows) failed on %s (%s: %s)", node.name, type(e).__name__, e)
        return None


def _rows_verdict(node: fx.Node, out_dim: int, length: int, world: int) -> Optional[Dict[int, int]]:
    if node.op not in ("call_function", "call_method") or _in_place(node):
        return None
    traced = _aten_graph(node, (length,))
    if traced is None:
        return None
    graph, tensors, placeholders = traced
    for p in placeholders:  # seed with each input dim of the right size; Want adds the others
        for d, size in enumerate(p.meta["val"].shape):
            if size == length:
                found = _seeded(graph, {p: d}, out_dim, length, world)
                if found is not None:
                    return {tensors[placeholders.index(q)]: e for q, e in found.items()}
    return None


def _seeded(graph: fx.GraphModule, seq: Dict[fx.Node, int], out_dim: int, length: int,
            world: int) -> Optional[Dict[fx.Node, int]]:
    from torch.distributed.tensor import Shard

    for _ in range(len(list(graph.graph.nodes))):
        out, want = propagate(graph, seq, world)
        if want is None:
            ok = isinstance(out, Shard) and out.dim == out_dim
            return dict(seq) if ok else None
        p, d = want
        if p in seq or tuple(p.meta["val"].shape)[d] != length:
            return None
        seq[p] = d
    return None
