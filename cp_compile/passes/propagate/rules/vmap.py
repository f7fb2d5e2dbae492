"""Layout rules for ``torch.vmap`` inlined by Dynamo: the batch dim a vmap adds and removes.

Dynamo traces ``torch.vmap(f)(x)`` into functorch's level bookkeeping around ``f``'s ops::

    _vmap_increment_nesting(B, 'error')
    xb = _add_batch_dim(x, 0, level)          # x (B, S, D) -> xb logically (S, D): dim 0 vmapped
    yb = f's ops on xb                        # per example; their fake values have the logical shapes
    y = _remove_batch_dim(yb, level, B, 0)    # -> (B, S, D) again
    _vmap_decrement_nesting()

The vmapped dim is not the sequence, so the sequence dim only moves: ``Sharded(d)`` becomes
``Sharded(d - 1)`` when the vmapped dim comes before it, and back when the batch dim is put back.
Inside the region the rules run on the logical shapes as usual. Vmapping over the sequence dim
itself, and any gather inside a vmap region (a collective cannot run on batched tensors), are
refused with the op and the fix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...context import CPRewriteError, source_line
from ..placements import Sharded
from .registry import register_rule

_PREDISPATCH = getattr(torch._functorch, "predispatch", None)
ADD_BATCH_DIM = getattr(_PREDISPATCH, "_add_batch_dim", None)
REMOVE_BATCH_DIM = getattr(_PREDISPATCH, "_remove_batch_dim", None)
INCREMENT = getattr(_PREDISPATCH, "_vmap_increment_nesting", None)
DECREMENT = getattr(_PREDISPATCH, "_vmap_decrement_nesting", None)


@register_rule(ADD_BATCH_DIM)
def add_batch_dim(em: Any, node: fx.Node):
    """``_add_batch_dim(x, batch_dim, level)``: the logical value drops ``batch_dim``."""
    x, batch_dim = node.args[0], node.args[1]
    s = em.layout(x)
    if not isinstance(s, Sharded) or batch_dim == s.dim:
        raise CPRewriteError(
            f"cp_compile: torch.vmap at {source_line(node)} maps over the sequence dim of a sequence-sharded "
            "value: each rank holds only its tokens, so the mapped function would see 1/N of them. Fix: vmap "
            "over another dim (the batch), or keep this computation out of the compiled model.")
    return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(s.dim - (batch_dim < s.dim), s.inner)


@register_rule(REMOVE_BATCH_DIM)
def remove_batch_dim(em: Any, node: fx.Node):
    """``_remove_batch_dim(x, level, batch_size, out_dim)``: the batch dim comes back at ``out_dim``."""
    x, out_dim = node.args[0], node.args[3]
    s = em.layout(x)
    if not isinstance(s, Sharded):
        return em.fallback(node, "a vmapped value sharded in an unknown way")
    return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(s.dim + (out_dim <= s.dim), s.inner)



__all__ = ["DECREMENT", "INCREMENT", "add_batch_dim", "remove_batch_dim"]
