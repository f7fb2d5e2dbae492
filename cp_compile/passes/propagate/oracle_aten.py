"""ATen-level sequence propagation for the rule oracle (:mod:`.oracle`).

:func:`trace` turns one FX node into an ATen graph on fake inputs of its global shapes;
:func:`propagate` runs DTensor's sharding propagation over that graph on a 1-D mesh of N
built without a process group, from ``Shard(d)`` on the inputs that carry the sequence:

    x (B, S, D) Shard(1) ─ aten.erf ─> Shard(1)              per-token: the output's Shard dim
    x (B, S, D) Shard(1) ─ aten.cumsum(dim=1) ─> redistribute  token mixing: _Stop (inside another op)
    pos (S, D) Replicate + x Shard(0) ─ aten.add ─> wants pos as Shard(0): _Want(pos, 0)

A whole input the propagator wants sharded is reported (:class:`Want`) so the caller can
index it by position and run again; any other redistribution of a sharded input stops.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..context import log
from ..op_vocab import arguments


def hint(v: Any) -> Any:
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    return guarding_hint_or_throw(v) if isinstance(v, torch.SymInt) else v


def trace(node: fx.Node, values: List[Any], spec: Any, tensors: List[int]) -> Optional[fx.GraphModule]:
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
        fakes = [torch.empty_strided(tuple(map(hint, v.shape)), tuple(map(hint, v.stride())), dtype=v.dtype,
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


class Want(Exception):
    """A whole placeholder must be Shard(dim) for an op to stay per-token."""

    def __init__(self, node: fx.Node, dim: int) -> None:
        super().__init__(node.name, dim)
        self.node, self.dim = node, dim


@functools.lru_cache(maxsize=None)
def _mesh(world: int) -> Any:
    """A 1-D DeviceMesh of ``world`` ranks, built without a process group (propagation only)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(world), _init_backend=False, _rank=0)


def propagate(graph: fx.GraphModule, seq: Dict[fx.Node, int], world: int) -> Tuple[Any, Optional[Tuple]]:
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
                out = fx.node.map_aggregate(n.args[0], lambda a: place.get(a) if isinstance(a, fx.Node) else None)
                return out, None
    except Want as w:
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
    """Allowed: a whole *placeholder* asked to become Shard(d) (raised as :class:`Want`)."""
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
            raise Want(a, pn.dim)
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


def _scan(n: fx.Node, place: Dict[fx.Node, Any]) -> Any:
    """``aten.cumsum`` / ``cumprod`` / ``logcumsumexp(x, dim)``: per-token unless it scans along the
    sequence dim. DTensor's scan strategy compares ``dim`` as written with the Shard dim, so a
    negative dim never matched and the scan came out sharded: each rank a running sum of its own
    tokens only, silently wrong (Hugging Face Kimi-Linear's ``g.cumsum(dim=-2)`` did, before the scans
    got their hand rule, :mod:`.rules.scans`)::

        x (B, S, D) Shard(1) ─ aten.cumsum(x, -2) ─> _Stop                  was: Shard(1)
        x (B, S, D) Shard(1) ─ aten.cumsum(x, -1) ─> Shard(1)              over the features

    A scan written as such never reaches the oracle now (its rule combines every rank's run totals);
    this guards a scan inside the decomposition of another op the oracle is asked about.
    """
    from torch.distributed.tensor import Shard

    pl, nd = place[n.args[0]], n.args[0].meta["val"].dim()
    dim = arguments(n, ("self", "dim"))["dim"]
    if isinstance(pl, Shard) and pl.dim != dim % max(nd, 1):
        return pl
    raise _Stop(f"{n.target} along the sequence dim")


def _pointwise_conv(n: fx.Node, place: Dict[fx.Node, Any]) -> Any:
    """``aten.convolution`` with a kernel of 1 along a sharded spatial dim (stride 1, no padding or
    dilation there, not transposed): each output position reads its own input position, as a linear
    does (Hugging Face SqueezeBERT's (B, C, S) 1x1 convolutions). DTensor replicates every convolution."""
    from torch.distributed.tensor import Replicate, Shard

    x, w, bias, stride, padding, dilation, transposed = n.args[:7]
    pl = place[x]
    if not isinstance(pl, Shard) or pl.dim < 2 or transposed or any(
            isinstance(place.get(a), Shard) for a in (w, bias) if isinstance(a, fx.Node)):
        raise _Stop("convolution along the sequence dim")
    i = pl.dim - 2
    if w.meta["val"].shape[pl.dim] != 1 or stride[i] != 1 or padding[i] != 0 or dilation[i] != 1:
        raise _Stop("convolution whose kernel spans several sequence positions")
    assert all(isinstance(place.get(a), Replicate) for a in (w, bias) if isinstance(a, fx.Node))
    return pl


_EXTRA: Dict[Any, Callable[[fx.Node, Dict[fx.Node, Any]], Any]] = {
    torch.ops.aten.flip.default: _flip, torch.ops.aten.convolution.default: _pointwise_conv,
    **dict.fromkeys((torch.ops.aten.cumsum.default, torch.ops.aten.cumprod.default,
                     torch.ops.aten.logcumsumexp.default), _scan)}
