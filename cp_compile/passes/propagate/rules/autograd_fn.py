"""Rule: a custom ``torch.autograd.Function`` whose forward and backward are per-token.

Dynamo keeps ``Fn.apply(x)`` as one higher-order op with both methods as subgraphs::

    autograd_function_apply(fwd_body, bwd_body, x, non_differentiable_idx=[], saved_for_backward_idx=[0])
    fwd_body(x) -> ((out, ..), (saved, ..))        bwd_body(grad_out, .., saved, ..) -> (grad_x, ..)

    x (B, S/N, D) Sharded(1)  ->  the same op on x's shard  ->  out (B, S/N, D) Sharded(1)

Both bodies are decided as the rule oracle decides an unknown op (:mod:`..oracle`): traced to
ATen on the global shapes and propagated with DTensor's rules from the operands' sequence dims.
The op is per-token when the forward leaves every output on its operand's rows (Shard(d)) and
saves values that are sharded the same way or whole, and the backward maps the output gradients
back to the operands' rows; then it runs unchanged on this rank's shards (Hugging Face BLOOM's
custom GeLU). An operand that needs a gradient must be sharded: a whole weight inside the
function would get a partial gradient that nothing sums. Bodies that bake a sequence length into
an op (a view to (B, S, ..)) are not decided. Anything else falls back (gathered, warned).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ...context import fake_value, global_shape, log
from ..placements import Sharded
from ..oracle_aten import hint, propagate
from .registry import register_rule

APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)
_CACHE: Dict[Any, Optional[Tuple[Sharded, ...]]] = {}


@register_rule(APPLY)
def autograd_function(em: Any, node: fx.Node) -> Tuple[Any, Any]:
    """The op on the local shards when both bodies are per-token, else the fallback."""
    try:
        layouts = _decide(em, node)
    except Exception as e:  # noqa: BLE001 - "don't know": the fallback
        log.debug("cp_compile: autograd function %s not decided (%s: %s)", node.name, type(e).__name__, e)
        layouts = None
    if layouts is None:
        return em.fallback(node, "a custom autograd.Function that is not known to be per-token")
    args, kwargs = em.value((node.args, node.kwargs))
    return em.copy(node, args, kwargs), layouts


def _decide(em: Any, node: fx.Node) -> Optional[Tuple[Sharded, ...]]:
    fwd, bwd = (getattr(em.gm, a.target) for a in node.args[:2])
    operands = list(node.args[2:])
    dims = [em.layout(a).dim if isinstance(em.layout(a), Sharded) and em.layout(a).inner == 1 else None
            for a in operands]
    if any(isinstance(em.layout(a), Sharded) and d is None for a, d in zip(operands, dims)):
        return None  # tokens merged with another dim: not decided here
    for a, d in zip(operands, dims):
        val = fake_value(a) if isinstance(a, fx.Node) else None
        if d is None and isinstance(val, torch.Tensor) and val.requires_grad:
            return None  # a whole operand would get a partial gradient
    token = {global_shape(a)[d] for a, d in zip(operands, dims) if d is not None}
    if len(token) != 1:
        return None
    (length,) = token
    key = (fwd.code, bwd.code, tuple(dims), tuple(_shape(a) for a in operands), em.ctx.world, length)
    if key not in _CACHE:
        lengths = {em.ctx.seq_len, em.ctx.padded_len, length}
        _CACHE[key] = None if _bakes(fwd, lengths) or _bakes(bwd, lengths) else \
            _per_token(fwd, bwd, operands, dims, length, em.ctx.world)
    return _CACHE[key]


def _shape(a: Any) -> Any:
    val = fake_value(a) if isinstance(a, fx.Node) else a
    return (tuple(global_shape(a)), val.dtype) if isinstance(val, torch.Tensor) else repr(val)


def _bakes(body: fx.GraphModule, lengths: set) -> bool:
    """Whether an op of ``body`` takes one of ``lengths`` as an int argument (a baked view size)."""
    for n in body.graph.nodes:
        flat = fx.node.map_aggregate((n.args, n.kwargs), lambda a: a)
        for a in _flatten(flat):
            if type(a) is int and a in lengths:
                return True
    return False


def _flatten(x: Any) -> List[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


def _per_token(fwd: fx.GraphModule, bwd: fx.GraphModule, operands: Sequence[Any], dims: Sequence[Optional[int]],
               length: int, world: int) -> Optional[Tuple[Sharded, ...]]:
    """The outputs' layouts when both bodies keep the tokens on their rows, else None."""
    from torch.distributed.tensor import Replicate, Shard

    values = [fake_value(a) if isinstance(a, fx.Node) else a for a in operands]
    traced = _trace(fwd, values)
    if traced is None:
        return None
    places, vals = _run(traced, [d for d in dims], world)
    if places is None or len(places) != 2:
        return None
    outs, saved = places
    out_vals, saved_vals = vals
    if not outs or not all(isinstance(p, Shard) and v.shape[p.dim] == length for p, v in zip(outs, out_vals)):
        return None
    if not all(isinstance(p, (Shard, Replicate)) for p in saved):
        return None
    back = _trace(bwd, [*out_vals, *saved_vals])
    if back is None:
        return None
    grad_dims = [p.dim for p in outs] + [p.dim if isinstance(p, Shard) else None for p in saved]
    grads, _ = _run(back, grad_dims, world)
    if grads is None:
        return None
    grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
    for g, d, v in zip(grads, dims, values):
        same_rows = isinstance(g, Shard) and g.dim == d
        if isinstance(v, torch.Tensor) and d is not None and g is not None and not same_rows:
            return None
    return tuple(Sharded(p.dim) for p in outs)


def _trace(body: fx.GraphModule, values: Sequence[Any]) -> Optional[fx.GraphModule]:
    """``body`` as an ATen graph on static fakes of ``values``' shapes (in their fake mode)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(tensors)
    if mode is None:
        return None
    with mode:
        fakes = [torch.empty_strided(tuple(map(hint, v.shape)), tuple(map(hint, v.stride())), dtype=v.dtype,
                                     device=v.device) if isinstance(v, torch.Tensor) else v for v in values]
    with torch.no_grad():
        return make_fx(body, tracing_mode="fake")(*fakes)


def _run(graph: fx.GraphModule, dims: Sequence[Optional[int]], world: int) -> Tuple[Any, Any]:
    """(output placements, output fake values) of ``graph`` with its placeholders sharded along ``dims``."""
    holders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    seq = {p: d for p, d in zip(holders, dims) if d is not None}
    out, want = propagate(graph, seq, world)
    if out is None or want is not None:
        return None, None
    node = next(n for n in graph.graph.nodes if n.op == "output")
    vals = fx.node.map_aggregate(node.args[0], lambda a: a.meta.get("val") if isinstance(a, fx.Node) else None)
    return out, vals



__all__ = ["autograd_function"]
