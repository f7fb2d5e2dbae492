"""The rule oracle: decide an op the rule table does not know from its ATen decomposition.

DESIGN.md §3.1, principle 3. Before :meth:`Emitter.fallback` gathers the sequence for
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
other dims) have a one-line rule in :data:`_EXTRA`.

If the whole decomposition is per-token, the *original* node is emitted on the local
values (not the ATen graph), with layout ``Sharded(out_dim)``; else :func:`decide`
returns None and the caller gathers. Verdicts are cached per (target, argument
structure, shapes, sharded dims), so repeated layers cost one trace. The oracle never
raises: any exception means "don't know" (logged at DEBUG), i.e. the fallback.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .context import fake_value, global_shape, log
from .layouts import Sharded

if TYPE_CHECKING:
    from .rewrite import Emitter


@dataclass(frozen=True)
class Verdict:
    """A per-token node: its output layout(s), and which whole inputs to index by position."""

    out: Any  # Sharded, or a tuple of Sharded for a multi-output op
    index: Tuple[Tuple[int, int], ...]  # (flat argument position, dim) of whole inputs to shard


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


def _key(em: "Emitter", node: fx.Node) -> Optional[Any]:
    """The cache key: target, argument structure, shapes/dtypes, constants and sharded dims."""
    if node.op not in ("call_function", "call_method") or _in_place(node):
        return None  # in place: indexing a whole operand would update a copy, not the value
    dims = _seq_dims(em, node)
    if dims is None:
        return None
    leaves, spec = _leaves(node)
    parts = []
    for a, d in zip(leaves, dims):
        val = fake_value(a) if isinstance(a, fx.Node) else a
        if isinstance(val, torch.Tensor):
            parts.append(("T", global_shape(a), val.dtype, str(val.device), d))
        elif isinstance(val, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            parts.append(("C", type(val).__name__, val))
        elif isinstance(val, torch.SymInt):
            parts.append(("C", "int", _hint(val)))
        else:
            return None
    return (node.op, node.target, str(spec), tuple(parts), em.ctx.world, em.ctx.seq_len)


def _in_place(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _hint(v: Any) -> Any:
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    return guarding_hint_or_throw(v) if isinstance(v, torch.SymInt) else v


def _verdict(em: "Emitter", node: fx.Node) -> Optional[Verdict]:
    leaves, spec = _leaves(node)
    dims = _seq_dims(em, node)
    S = em.ctx.seq_len
    values = [_hint(fake_value(a)) if isinstance(a, fx.Node) else a for a in leaves]
    if any(type(v) is int and v in (S, em.ctx.padded_len) for v in values):
        return None  # a length baked into the arguments would be wrong on the local values
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    graph = _trace(node, values, spec, tensors)
    if graph is None:
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    seq = {p: dims[i] for p, i in zip(placeholders, tensors) if dims[i] is not None}
    whole = {p: i for p, i in zip(placeholders, tensors) if dims[i] is None}
    for _ in range(len(whole) + 1):  # each round may shard one more whole input, then re-runs
        out, want = _propagate(graph, seq, em.ctx.world)
        if want is None:
            return _finish(out, graph, seq, whole, S)
        p, d = want
        if p not in whole or p in seq or tuple(p.meta["val"].shape)[d] != S:
            return None  # a whole value that is not a per-position table of the node's inputs
        seq[p] = d
    return None


def _finish(out: Any, graph: fx.GraphModule, seq: Dict[fx.Node, int], whole: Dict[fx.Node, int],
            S: int) -> Optional[Verdict]:
    """The verdict from the output placements (every tensor output Shard(d) along a dim of size S)."""
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
        layouts.append(Sharded(pl.dim))
    index = tuple((whole[p], d) for p, d in seq.items() if p in whole)
    single = not isinstance(out, (tuple, list))
    return Verdict(layouts[0] if single else tuple(layouts), index)


def _trace(node: fx.Node, values: List[Any], spec: Any, tensors: List[int]) -> Optional[fx.GraphModule]:
    """The node alone as an ATen graph, on static fake inputs of the global shapes.

    The fakes are made in the example values' own fake mode (Dynamo's: tracing inside a
    backend finds it through the tracing context, and another mode would be "Mixing fake
    modes"), with concrete sizes, so no guard is added to Dynamo's shape environment."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode([values[i] for i in tensors])
    if mode is None:
        return None
    with mode:
        fakes = [torch.empty_strided(tuple(map(_hint, v.shape)), tuple(map(_hint, v.stride())), dtype=v.dtype,
                                     device=v.device) for v in (values[i] for i in tensors)]

    def fn(*ts: torch.Tensor) -> Any:
        leaves = list(values)
        for i, t in zip(tensors, ts):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, spec)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake")(*fakes)


# ----------------------------------------------------------------------------- ATen propagation
class _Stop(Exception):
    """Propagation cannot keep the sequence sharded (a token-mixing ATen op)."""


class _Want(Exception):
    """A whole placeholder must be Shard(dim) for an op to stay per-token."""

    def __init__(self, node: fx.Node, dim: int) -> None:
        super().__init__(node.name, dim)
        self.node, self.dim = node, dim


@functools.lru_cache(maxsize=None)
def _mesh(world: int) -> Any:
    """A 1-D DeviceMesh of ``world`` ranks, built without a process group (propagation only)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(world), _init_backend=False, _rank=0)


def _propagate(graph: fx.GraphModule, seq: Dict[fx.Node, int], world: int) -> Tuple[Any, Optional[Tuple]]:
    """Placements of the graph's outputs, or ``(None, (placeholder, dim))`` when a whole
    placeholder must be sharded, or ``(None, None)`` when some op mixes tokens."""
    from torch.distributed.tensor import Replicate, Shard

    place: Dict[fx.Node, Any] = {}
    try:
        for n in graph.graph.nodes:
            if n.op == "placeholder":
                place[n] = Shard(seq[n]) if n in seq else Replicate()
            elif n.op == "get_attr":
                place[n] = Replicate()
            elif n.op == "call_function":
                place[n] = _step(n, place, _mesh(world))
            elif n.op == "output":
                return fx.node.map_aggregate(n.args[0], lambda a: place.get(a) if isinstance(a, fx.Node) else None), None
    except _Want as w:
        return None, (w.node, w.dim)
    except _Stop as e:
        log.debug("cp_compile: rule oracle: %s", e)
    return None, None


def _step(n: fx.Node, place: Dict[fx.Node, Any], mesh: Any) -> Any:
    """The output placement(s) of one ATen node given its inputs' placements."""
    from torch.distributed.tensor import Replicate, Shard

    ins = [a for a in n.all_input_nodes]
    if all(isinstance(place.get(a), Replicate) or place.get(a) is None for a in ins):
        return _replicate_like(n)
    if n.target is operator.getitem:
        return place[n.args[0]][n.args[1]]
    if not isinstance(n.target, torch._ops.OpOverload):
        raise _Stop(f"{n.target} on a sharded value")
    if torch.Tag.nondeterministic_seeded in n.target.tags:
        raise _Stop(f"{n.target} draws random numbers: per-rank draws differ from one process's")
    extra = _EXTRA.get(n.target)
    if extra is not None:
        return extra(n, place)
    return _dtensor_step(n, place, mesh, Shard)


def _replicate_like(n: fx.Node) -> Any:
    from torch.distributed.tensor import Replicate

    val = n.meta.get("val")
    return tuple(Replicate() for _ in val) if isinstance(val, (tuple, list)) else Replicate()


def _dtensor_step(n: fx.Node, place: Dict[fx.Node, Any], mesh: Any, Shard: type) -> Any:
    """Ask DTensor's sharding propagator; refuse any redistribution of a sharded input."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema

    prop = DTensor._op_dispatcher.sharding_propagator

    def spec(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        return DTensorSpec(mesh, (place[a],), TensorMeta(v.shape, v.stride(), v.dtype))

    args, kwargs = fx.node.map_aggregate((n.args, n.kwargs), spec)
    schema = OpSchema(n.target, tuple(args), dict(kwargs), schema_info=prop.op_to_schema_info.get(n.target))
    result = prop.propagate_op_sharding(schema)
    if result.needs_redistribute and result.redistribute_schema is not None:
        _check_redistribution(n, schema, result.redistribute_schema, Shard)
    return fx.node.map_aggregate(result.output_spec, lambda s: s.placements[0] if s is not None else None)


def _check_redistribution(n: fx.Node, given: Any, wanted: Any, Shard: type) -> None:
    """Allowed: a whole *placeholder* asked to become Shard(d) (raised as :class:`_Want`)."""
    from torch.distributed.tensor import Replicate

    old_specs, new_specs = _flat_specs(given), _flat_specs(wanted)
    nodes = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, fx.Node)
             and isinstance(a.meta.get("val"), torch.Tensor)]
    if len(old_specs) != len(new_specs) or len(nodes) != len(old_specs):
        raise _Stop(f"{n.target}: unexpected redistribution schema")
    for a, old, new in zip(nodes, old_specs, new_specs):
        po, pn = old.placements[0], new.placements[0]
        if po == pn:
            continue
        if isinstance(po, Replicate) and isinstance(pn, Shard) and a.op == "placeholder":
            raise _Want(a, pn.dim)
        raise _Stop(f"{n.target} needs {a.name} as {pn} (given {po})")


def _flat_specs(schema: Any) -> List[Any]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return [s for s in tree_flatten((schema.args_schema, schema.kwargs_schema))[0] if isinstance(s, DTensorSpec)]


def _flip(n: fx.Node, place: Dict[fx.Node, Any]) -> Any:
    """``aten.flip(x, dims)``: per-token unless it reverses the sequence dim (DTensor replicates)."""
    from torch.distributed.tensor import Shard

    pl, nd = place[n.args[0]], n.args[0].meta["val"].dim()
    if isinstance(pl, Shard) and pl.dim not in {d % nd for d in n.args[1]}:
        return pl
    raise _Stop("flip along the sequence dim")


_EXTRA: Dict[Any, Callable[[fx.Node, Dict[fx.Node, Any]], Any]] = {torch.ops.aten.flip.default: _flip}


# ----------------------------------------------------------------------------- emitting
def _emit(em: "Emitter", node: fx.Node, verdict: Verdict) -> Tuple[fx.Node, Any]:
    """The original node on the local values; whole per-position inputs indexed by position."""
    leaves, spec = _leaves(node)
    index = dict(verdict.index)
    new = [em.to_sharded(a, index[i]) if i in index else (em.env[a] if isinstance(a, fx.Node) else a)
           for i, a in enumerate(leaves)]
    args, kwargs = tree_unflatten(new, spec)
    return em.copy(node, tuple(args), dict(kwargs)), verdict.out
