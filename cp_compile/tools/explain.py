"""Graph inspection for ``cp-compile dump`` / ``cp-compile explain``, in one process.

No process group is needed: the model is traced once by Dynamo with a capturing
backend, and the ``ring_cp`` pipeline (:data:`cp_compile.passes.pipeline.PASSES`, through
:func:`~cp_compile.backend.compiler.rewrite_for_cp`, as in ``RingCP.__call__``) runs on
a copy of the graph for a synthetic CP group ``CPGroup(pg=None, rank=r, size=N)``.
The rewritten graph is never run; its nodes carry ``meta["val"]`` (rank r's local
fake value) and, for nodes copied from the original graph, ``facts(node).global_val``
(:mod:`cp_compile.passes.node_facts`).

The passes run *inside* the capture callback: Dynamo drops the placeholders'
``grapharg`` metadata (which names the forward() argument behind each input) once
the backend returns, and ``choose_seq_inputs`` needs it.

What the rewritten graph costs each rank (collectives, activation bytes, the masks the
ring ops receive) is read off its nodes by :mod:`cp_compile.backend.cost`; each ring op's call
(its :class:`cp_compile.ring.call_spec.RingCall`) by :func:`cp_compile.passes.ring_call.ring_call`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..group import CPGroup
from ..options import LOAD_BALANCES, RewriteOptions, check_choice
from ..backend.cost import KINDS, Collective, RingSite, activation_bytes, collectives, nbytes, node_kind  # noqa: F401
from ..backend.cost import ring_sites
from ..backend.cost import to_int as _int
from ..passes.context import RewriteContext, source_line
from ..passes.node_facts import facts
from ..passes.analyze.graph_inputs import user_name


class ExplainError(RuntimeError):
    """The model could not be traced or rewritten; the message names the fix."""


# ---------------------------------------------------------------------------------- report
@dataclass
class NodeRow:
    """One node of a graph as dump shows it."""

    name: str
    op: str
    target: str
    kind: str  # one of KINDS, or "" for nodes copied from the original graph
    status: str  # "inserted" | "rewritten" (copied, arguments changed) | "" (copied unchanged)
    source: str
    global_shape: Any  # tuple, list of tuples (multi-output), or None
    local_shape: Any

    @property
    def marked(self) -> bool:
        """Inserted or rewritten by ring_cp (dump marks it with *)."""
        return bool(self.status)


@dataclass
class FallbackInfo:
    """One op the rewrite runs on the gathered full sequence, and the bytes its gathers bring."""

    node: str
    source: str
    message: str
    gathered_bytes: int


@dataclass
class Report:
    """Everything dump and explain show about one rewrite (per-rank figures for ``ctx.group.rank``)."""

    world_size: int
    load_balance: str
    before: fx.GraphModule
    after: fx.GraphModule  # == before when the graph has no attention (the backend leaves it unchanged)
    ctx: RewriteContext
    input_names: Dict[str, str]  # placeholder name -> forward() argument (or parameter/buffer path)
    before_rows: List[NodeRow]
    after_rows: List[NodeRow]
    attention: List[Tuple[str, str]]  # (node name, source line) of each SDPA in the original graph
    rings: List[RingSite]  # per attention (same order): its ring op's call and the mask tensors it is given
    shard_inputs: Dict[str, int]  # forward() argument -> sequence dim
    fallbacks: List[FallbackInfo]
    collectives: List[Collective]
    act_bytes_local: int
    act_bytes_global: int
    aot_forward: Optional[fx.GraphModule] = None  # AOTAutograd's partition of the rewritten graph (aot=True)
    aot_backward: Optional[fx.GraphModule] = None

    @property
    def rewritten(self) -> bool:
        """Whether the graph had attention (else the backend compiles it unchanged)."""
        return self.after is not self.before


def explain_model(model: torch.nn.Module, example_inputs: Sequence[Any], world_size: int = 2,
            load_balance: str = "zigzag", aot: bool = False, example_kwargs: Optional[Dict[str, Any]] = None,
            rank: int = 0, dynamic: bool = False, **opts: Any) -> Report:
    """Trace ``model(*example_inputs, **example_kwargs)`` with Dynamo and rewrite it for a CP group
    of ``world_size`` (the forms a ``cp-compile`` factory returns: :func:`cp_compile.tools.targets.example_inputs`).

    ``rank``: whose graph to show (ranks differ where the sequence is assembled inside the
    graph: each takes its own rows of the pieces). ``dynamic``: trace with a symbolic sequence
    length, as ``torch.compile(..., dynamic=True)`` does (always, under ``inputs="local"``,
    which needs it). ``opts``: the other :class:`~cp_compile.options.RewriteOptions` (rotate,
    kernel, seq_inputs, inputs, outputs, grad_sync, strict). ``aot``: also partition the rewritten graph with
    AOTAutograd (fake tensors only) into the forward and backward graphs the inner
    compiler would get. Resets Dynamo's caches first (each call traces anew).
    Raises :class:`ExplainError` when tracing fails and CPRewriteError when the
    rewrite refuses the model.
    """
    _check_args(world_size, load_balance, rank)
    ctx = RewriteContext(group=CPGroup(pg=None, rank=rank, size=world_size),
                         options=RewriteOptions(load_balance=load_balance, **opts))
    state: Dict[str, Any] = {}

    def capture(gm: fx.GraphModule, ex: List[Any]) -> Callable:
        if "before" in state:  # a second graph: only possible without fullgraph
            return gm.forward
        try:
            state.update(_run_passes(gm, ex, ctx))
            if aot and state["after"] is not state["before"]:
                state.update(_aot_graphs(state["after"], ex))
        except BaseException as e:  # re-raised outside Dynamo, unwrapped
            state["error"] = e
        return gm.forward

    torch._dynamo.reset()
    try:
        dynamic = dynamic or opts.get("inputs") == "local"
        compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=dynamic)
        compiled(*example_inputs, **(example_kwargs or {}))
    except Exception as e:
        if "error" in state:
            raise state["error"]
        raise ExplainError(f"Dynamo could not capture the model as one graph ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}). Fix: remove graph breaks "
                           "(dump/explain inspect one whole graph), or check that the example inputs fit the "
                           "model.") from e
    finally:
        torch._dynamo.reset()
    if "error" in state:
        raise state["error"]
    if "before" not in state:
        raise ExplainError("Dynamo produced no graph for this model (nothing to compile?).")
    return _build_report(world_size, load_balance, ctx, **state)


def _check_args(world_size: Any, load_balance: Any, rank: Any) -> None:
    """Refuse a CP group explain cannot show (naming the fix)."""
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"cp_compile: world_size must be an int >= 2 (a CP group of 1 is not rewritten), "
                         f"got {world_size!r}.")
    check_choice("load_balance", load_balance, LOAD_BALANCES)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"cp_compile: rank must be in [0, {world_size}), got {rank!r}.")


def _aot_graphs(gm: fx.GraphModule, ex: List[Any]) -> Dict[str, fx.GraphModule]:
    """The forward and backward graphs AOTAutograd makes of ``gm`` (traced on fake tensors)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition

    got: Dict[str, fx.GraphModule] = {}

    def partition(joint: fx.GraphModule, inputs: Any, **kw: Any):
        fw, bw = default_partition(joint, inputs, **kw)
        got["aot_forward"], got["aot_backward"] = fw, bw
        return fw, bw

    def keep(g: fx.GraphModule, _ex: Any) -> Callable:
        got.setdefault("aot_forward", g)  # inference graphs skip the partition
        return make_boxed_func(g.forward)

    aot_module_simplified(gm, ex, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)
    return got


def _run_passes(gm: fx.GraphModule, ex: List[Any], ctx: RewriteContext) -> Dict[str, Any]:
    """What RingCP.__call__ does, on a copy of ``gm`` (Dynamo's own graph is left untouched)."""
    from ..backend.compiler import rewrite_for_cp

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    before = fx.GraphModule(gm, graph)  # node meta copied (shallow): grapharg, example_value, stack_trace
    input_names = {n.name: user_name(n) for n in before.graph.nodes if n.op == "placeholder"}
    after = rewrite_for_cp(before, ex, ctx)
    return {"before": before, "after": after if after is not None else before, "input_names": input_names}


# ---------------------------------------------------------------------------------- helpers
def _shape(val: Any) -> Any:
    """A tensor's shape as ints, a list of shapes for a tuple of tensors, else None."""
    if isinstance(val, torch.Tensor):
        return tuple(_int(d) for d in val.shape)
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return [tuple(_int(d) for d in v.shape) for v in val]
    return None


def format_shape(shape: Any) -> str:
    """``(2, 64)``, ``[(2, 64), (2,)]`` for several outputs, ``-`` for none."""
    if shape is None:
        return "-"
    if isinstance(shape, list):
        return "[" + ", ".join(map(str, shape)) + "]"
    return str(shape)


def target_name(node: fx.Node, input_names: Optional[Dict[str, str]] = None) -> str:
    """What a node calls, as dump shows it (a placeholder: the forward() argument behind it)."""
    if node.op == "placeholder":
        return (input_names or {}).get(node.name, str(node.target))
    if node.op == "call_method":
        return "." + str(node.target)
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return str(t).removesuffix(".default")
        return getattr(t, "__name__", str(t))
    if node.op == "output":
        return "output"
    return str(node.target)


def _origin_map(before: fx.GraphModule, after: fx.GraphModule) -> Dict[fx.Node, fx.Node]:
    """New node -> the original node it was copied from (copies share the fake value object)."""
    by_val = {id(n.meta["example_value"]): n for n in before.graph.nodes if n.meta.get("example_value") is not None}
    out = {}
    for n in after.graph.nodes:
        val = facts(n).global_val
        if val is not None and id(val) in by_val:
            out[n] = by_val[id(val)]
        elif n.op in ("placeholder", "output"):
            out[n] = next((o for o in before.graph.nodes if o.op == n.op and o.name == n.name), None)
    return {k: v for k, v in out.items() if v is not None}


def _same_args(new: fx.Node, old: fx.Node, origin: Dict[fx.Node, fx.Node]) -> bool:
    """Whether ``new`` calls what ``old`` did on the copies of the same arguments."""
    def norm_new(a):
        return ("node", origin[a].name) if a in origin else ("new", a.name)

    def norm_old(a):
        return ("node", a.name)

    mapped_new = fx.node.map_aggregate((new.args, new.kwargs), lambda a: norm_new(a) if isinstance(a, fx.Node) else a)
    mapped_old = fx.node.map_aggregate((old.args, old.kwargs), lambda a: norm_old(a) if isinstance(a, fx.Node) else a)
    return new.target == old.target and repr(mapped_new) == repr(mapped_old)


def short_source(src: str) -> str:
    """A source line with the working directory's prefix removed."""
    cwd = os.getcwd() + os.sep
    return src.replace(cwd, "") if src else src


def _rows_before(gm: fx.GraphModule, names: Dict[str, str]) -> List[NodeRow]:
    """The rows of the Dynamo graph (global shapes)."""
    rows = []
    for n in gm.graph.nodes:
        shape = _shape(n.meta.get("example_value"))
        src = source_line(n) if n.meta.get("stack_trace") else ""
        rows.append(NodeRow(n.name, n.op, target_name(n, names), "", "", src, shape, shape))
    return rows


def _rows_after(before: fx.GraphModule, after: fx.GraphModule, names: Dict[str, str],
                attention_src: List[str]) -> List[NodeRow]:
    """The rows of the rewritten graph (global -> local shapes); ring ops carry their attention's source
    line (one ring op per original attention, in graph order)."""
    origin = _origin_map(before, after)
    rows, rings = [], iter(attention_src)
    for n in after.graph.nodes:
        kind = node_kind(n)
        old = origin.get(n)
        if old is None:
            status = "inserted"
        elif n.op in ("placeholder", "get_attr") or _same_args(n, old, origin):
            status = ""
        else:
            status = "rewritten"
        if status == "inserted" and n.op == "call_method" and n.target == "index_select":
            kind = "shard"  # a value indexed by this rank's sequence positions
        src = source_line(n) if n.meta.get("stack_trace") else ""
        if kind == "ring_attention":
            src = next(rings, "")  # one ring op per original attention, in graph order
        glob = _shape(facts(n).global_val)
        loc = _shape(n.meta.get("val"))
        if glob is None and kind == "gather":
            glob = loc  # a gather's value is the full sequence on every rank
        rows.append(NodeRow(n.name, n.op, target_name(n, names), kind, status, src, glob, loc))
    return rows


def _build_report(world_size: int, load_balance: str, ctx: RewriteContext, before: fx.GraphModule,
                  after: fx.GraphModule, input_names: Dict[str, str],
                  aot_forward: Optional[fx.GraphModule] = None,
                  aot_backward: Optional[fx.GraphModule] = None) -> Report:
    """The :class:`Report` of one rewrite; every per-rank figure is read off ``after``."""
    attention = [(n.name, source_line(n)) for n in ctx.attention]
    before_rows = _rows_before(before, input_names)
    rewritten = after is not before
    after_rows = _rows_after(before, after, input_names, [s for _, s in attention]) if rewritten else before_rows
    shard_inputs = {input_names.get(k, k): d for k, d in ctx.shard_inputs.items()}
    fallbacks, gathers = _fallbacks(before, after, ctx) if rewritten else ([], [])
    return Report(world_size, load_balance, before, after, ctx, input_names, before_rows, after_rows, attention,
                  ring_sites(after, [n for n, _ in attention]) if rewritten else [], shard_inputs, fallbacks,
                  collectives(after, world_size, gathers) if rewritten else [],
                  ctx.record.act_bytes_local, ctx.record.act_bytes_global,  # counted once, by rewrite_for_cp
                  aot_forward, aot_backward)


def _fallbacks(before: fx.GraphModule, after: fx.GraphModule,
               ctx: RewriteContext) -> Tuple[List[FallbackInfo], List[fx.Node]]:
    """Each op the rewrite ran on the gathered sequence (with its gathers' bytes), and every gather node."""
    origin = _origin_map(before, after)
    copy_of = {old.name: new for new, old in origin.items()}
    fallbacks: List[FallbackInfo] = []
    gathers: List[fx.Node] = []
    for msg in ctx.fallbacks:
        m = re.search(r"\(node ([^)\s]+)\) at (.*)$", msg)
        name, src = (m.group(1), m.group(2)) if m else ("?", "")
        new = copy_of.get(name)
        gs = [a for a in (new.all_input_nodes if new is not None else []) if node_kind(a) == "gather"]
        gathers.extend(g for g in gs if g not in gathers)
        fallbacks.append(FallbackInfo(name, src, msg, sum(nbytes(g.meta.get("val")) for g in gs)))
    gathers.extend(n for n in after.graph.nodes if node_kind(n) == "gather" and n not in gathers)
    return fallbacks, gathers
