"""Rules for losses over the sequence-sharded tokens: exact global reductions.

    cross_entropy(logits (B·S/N, V) Sharded(0), labels Sharded(0) or whole, reduction="mean")
        -> all_reduce_sum(local sum over this rank's tokens) / all_reduce_sum(this rank's valid count)  Global
    mse_loss(x Sharded(1), y) -> all_reduce_sum(local sum of terms, padding rows zeroed) / global count  Global

Padding rows count as ignored targets (class losses) or add nothing (elementwise losses);
reduction="none" stays Sharded. Legacy arguments (size_average, reduce), class weights with a
mean, and operands sharded differently take the gather fallback.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .... import graph_ops
from ...context import global_shape
from ...op_vocab import CLASS_LOSSES, ELEMENTWISE_LOSSES, arguments
from ..placements import GLOBAL, Sharded
from .common import _flat_args
from .registry import register_rule, window_aware


def _target_dim(input_dim: int, input_nd: int) -> int:
    """Class-index losses: input (N, C, d1, ...) pairs with target (N, d1, ...)."""
    if input_nd == 1 or input_dim == 0:
        return 0
    return input_dim - 1


def _global_sum(em, local_sum: fx.Node) -> fx.Node:
    """The sum over the CP group of each rank's ``local_sum``."""
    return em.call(graph_ops.all_reduce_sum, local_sum, em.ctx.group.name)


@window_aware
@register_rule(*CLASS_LOSSES)
def class_loss(em, node: fx.Node):
    """cross_entropy / nll_loss: local sum over this rank's tokens, divided by the global valid count."""
    a = arguments(node)
    inp, tgt = a["input"], a["target"]
    s = em.layout(inp)
    if not isinstance(s, Sharded) or a.get("size_average") is not None or a.get("reduce") is not None:
        return em.fallback(node, f"{node.target.__name__} with legacy or unsharded arguments")
    td = _target_dim(s.dim, len(global_shape(inp)))
    t_lay = em.layout(tgt)
    if isinstance(t_lay, Sharded) and (t_lay.dim, t_lay.inner, t_lay.window) != (td, s.inner, s.window):
        return em.fallback(node, "loss target sharded differently from its input")
    if s.window is not None and any(em.windowed(v) for v in _flat_args(node) if v not in (inp, tgt)):
        return em.fallback(node, f"{node.target.__name__} with other sharded arguments")
    new_tgt = em.env[tgt] if isinstance(t_lay, Sharded) else em.to_sharded(tgt, td, s.inner, s.window)
    kwargs = {k: em.value(v) for k, v in a.items() if k not in ("input", "target", "size_average", "reduce")}
    reduction = kwargs.pop("reduction")
    mask = em.valid_mask(tgt, new_tgt, td, s.inner, s.window)  # padding rows, and rows outside a window
    if mask is not None:  # padding rows count as ignored targets
        new_tgt = em.call(torch.where, mask, new_tgt, kwargs["ignore_index"])
    local = em.call(node.target, em.env[inp], new_tgt, **kwargs, reduction="none" if reduction == "none" else "sum")
    if reduction == "none":
        return local, Sharded(td, s.inner, s.window)
    if kwargs.get("weight") is not None and reduction == "mean":
        return em.fallback(node, f"{node.target.__name__} with class weights and mean reduction")
    dtype = global_dtype(node)
    wide = dtype in (torch.bfloat16, torch.float16)  # the ranks' sums and the division in fp32, rounded once
    total = _global_sum(em, em.method("float", local) if wide else local)
    if reduction == "mean":
        valid = em.method("sum", em.call(operator.ne, new_tgt, kwargs["ignore_index"]))
        count = _global_sum(em, em.method("to", valid, torch.float32))
        total = em.call(operator.truediv, total, count if wide else em.method("to", count, dtype))
    return (em.method("to", total, dtype) if wide else total), GLOBAL


def global_dtype(node: fx.Node) -> torch.dtype:
    """The dtype of ``node``'s (one-process) value."""
    return node.meta["example_value"].dtype


@window_aware
@register_rule(*ELEMENTWISE_LOSSES)
def elementwise_loss(em, node: fx.Node):
    """mse_loss / l1_loss: per-element terms; mean divides by the global element count."""
    a = arguments(node)
    inp, tgt = a["input"], a["target"]
    if a.get("size_average") is not None or a.get("reduce") is not None or a.get("weight") is not None:
        return em.fallback(node, f"{node.target.__name__} with legacy or weight arguments")
    s = em.layout(inp) if isinstance(em.layout(inp), Sharded) else em.layout(tgt)
    if any(isinstance(em.layout(t), Sharded) and em.layout(t) != s for t in (inp, tgt)):
        return em.fallback(node, "loss operands sharded differently")
    new = [em.env[t] if isinstance(em.layout(t), Sharded) else em.to_sharded(t, s.dim, s.inner, s.window)
           for t in (inp, tgt)]
    reduction = a["reduction"]
    local = em.call(node.target, *new, reduction="none")
    if reduction == "none":
        return local, s
    ref = inp if isinstance(em.layout(inp), Sharded) else tgt
    mask = em.valid_mask(ref, local, s.dim, s.inner)
    if mask is not None:
        local = em.call(torch.where, mask, local, 0.0)
    if reduction == "mean":  # / global element count = local count / c * S (a window's n)
        length = em.index.S() if s.window is None else s.window[1]
        count = em.index.op(operator.mul, em.index.op(operator.floordiv, em.method("numel", local), em.index.c()),
                            length)
        return _global_sum(em, em.call(operator.truediv, em.method("sum", local), count)), GLOBAL
    local = em.method("sum", local)
    return _global_sum(em, local), GLOBAL

