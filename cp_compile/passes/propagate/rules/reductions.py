"""Layout rules for reductions over the sequence and for sizes (docs/design.md §6).

    x (B, S/N, D).sum(1)   -> all_reduce_sum(local sum, padding rows zeroed) -> Global (B, D)
    x.mean(1)              -> the same / the global count S
    x.size(1)              -> S (Global: the global size), under dynamic shapes a graph value
    torch.histc(x, E, 0, E) -> all_reduce_sum(local histogram, padding rows outside the range) -> Global
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...context import fake_value, global_shape
from ...op_vocab import arguments
from ..emitter import Emitter
from ..placements import GLOBAL
from .common import _name, _ndim, _norm, _sharded
from .registry import chunk_aware, register_rule, window_aware


@chunk_aware
@window_aware
@register_rule("sum", "mean", torch.sum, torch.mean)
def reduction(em: Emitter, node: fx.Node):
    """sum / mean: over other dims Sharded; over the sequence the local sums all-reduced -> Global."""
    x, s, nd, name = node.args[0], _sharded(em, node.args[0]), _ndim(node.args[0]), _name(node)
    a = arguments(node, ("input", "dim", "keepdim"))
    dim, keep = a.get("dim"), a.get("keepdim", False)
    dim = dim if dim is None or isinstance(dim, (list, tuple)) else [dim]
    dims = list(range(nd)) if dim is None else [_norm(d, nd) for d in dim]
    if s.dim not in dims:
        shift = 0 if keep else sum(1 for d in dims if d < s.dim)
        return em.copy(node, *em.value((node.args, node.kwargs))), s.moved(s.dim - shift)
    if name not in ("sum", "mean") or a.get("dtype") is not None or set(a) - {"input", "dim", "keepdim", "dtype"}:
        return em.fallback(node, f"{name} over the sequence dim")
    mask = em.valid_mask(x, em.env[x], s.dim, s.inner)  # (a window's: False outside it too)
    zero = 0.0 if fake_value(x).is_floating_point() else 0  # (an int 0: a float one would promote integer sums)
    local = em.env[x] if mask is None else em.call(torch.where, mask, em.env[x], zero)  # padding adds nothing
    total = em.method("sum", local, dims, keep)
    if name == "mean":  # / global count: the other reduced dims' sizes times S (a window's n)
        count = em.index.S() if s.window is None else s.window[1]  # times outer·inner when the tokens are
        merged = 1 if s.window is not None else global_shape(x)[s.dim] // em.ctx.seq_len  # flattened (B·S rows)
        if s.chunk > 1:  # (static S) one entry per chunk: the dim's own global size
            count, merged = global_shape(x)[s.dim], 1
        count = count if merged == 1 else em.index.op(operator.mul, count, merged)
        for d in dims:
            if d != s.dim:
                count = em.index.op(operator.mul, count, em.method("size", em.env[x], d))
        total = em.call(operator.truediv, total, count)
    from .... import graph_ops

    return em.call(graph_ops.all_reduce_sum, total, em.ctx.group.name), GLOBAL


@register_rule(torch.histc, "histc")
def histc(em: Emitter, node: fx.Node):
    """``torch.histc(x, bins, min, max)`` of a Sharded x (tokens per expert): the local histogram with the
    padding rows moved outside [min, max] (histc ignores them), summed over the group -> Global. A range
    read from the data (min == max) is gathered."""
    x, s = node.args[0], _sharded(em, node.args[0])
    given = arguments(node, ("input", "bins", "min", "max"))
    lo, hi = given.get("min", 0), given.get("max", 0)
    if not all(isinstance(v, (int, float)) for v in (lo, hi)) or lo >= hi:
        return em.fallback(node, "histc with its range read from the data")
    mask = em.valid_mask(x, em.env[x], s.dim, s.inner)
    local = em.env[x] if mask is None else em.call(torch.where, mask, em.env[x], lo - 1)  # outside the range
    counts = em.copy(node, (local, *em.value(node.args[1:])), em.value(node.kwargs))
    from .... import graph_ops

    return em.call(graph_ops.all_reduce_sum, counts, em.ctx.group.name), GLOBAL


@chunk_aware  # chunks too (static S only)
@window_aware  # windows exist under a static S only, where the sizes are the global (windowed) shape's
@register_rule("size")
def size(em: Emitter, node: fx.Node):
    """``x.size()`` / ``x.size(d)`` of a Sharded x: the *global* sizes (Dynamo emits them under
    dynamic shapes, e.g. ``y.reshape(x.size())``), the sequence dim as S. Global: a tuple of
    ints and graph values, which the view rule makes local again where it is a length."""
    x, s = node.args[0], _sharded(em, node.args[0])
    shape, idx = global_shape(x), em.index

    def one(d: int) -> Any:
        if em.ctx.seq_sym is None:
            return shape[d]
        local = em.method("size", em.env[x], d)
        return idx.op(operator.mul, idx.op(operator.floordiv, local, idx.c()), idx.S()) if d == s.dim else local

    dim = arguments(node, ("input", "dim")).get("dim")
    return (one(dim % len(shape)) if dim is not None else tuple(one(d) for d in range(len(shape)))), GLOBAL
