"""Layout rule for writes ``dst[idx] = value`` into a Sharded value, the index off its sequence dim.

    attn (B, H, n/N, C, C) Sharded(2, chunk=C)   attn[..., i, :i] = row (B, H, n/N, i) Sharded(2, chunk=C)
        -> the same write on this rank's chunks (no communication)
    buf (B, S/N, D) Sharded(1)                   buf[..., :4] = 0.0 / w (4,) Global
        -> the same write on this rank's rows

A basic index (ints, slices, ``...``, ``None``) that takes the whole sequence dim writes the same
entries of every position, so each rank writes its own positions: the value must be Sharded along
the dim the sequence has in ``dst[idx]`` (in the same chunks), or hold no extent there (a constant, a
Global value broadcast along it). Anything else (an index on the sequence dim, a slice of the
sequence, tensor indices, a whole destination) takes the path of an op with no rule (the oracle,
else a gather, warned). Kimi's and Gated DeltaNet's chunked delta rule build their in-chunk solve by
such writes, one row at a time (``attn[..., i, :i] = row + ...``).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ...context import fake_value, global_shape
from ..emitter import Emitter
from ..oracle import decide
from ..placements import Sharded
from .getitem import _covers, _expand_ellipsis, seq_entry
from .registry import chunk_aware, register_rule


@chunk_aware
@register_rule(operator.setitem)
def setitem(em: Emitter, node: fx.Node):
    """``dst[idx] = value`` on this rank's positions (see the module docstring)."""
    dst, index, value = node.args
    why = _refusal(em, dst, index, value)
    if why is not None:
        return decide(em, node) or em.fallback(node, f"setitem {why}")
    return em.copy(node, (em.env[dst], em.value(index), em.value(value)), {}), None


def _refusal(em: Emitter, dst: fx.Node, index: Any, value: Any) -> Optional[str]:
    """Why the write is not on this rank's own positions, or None."""
    s = em.layout(dst)
    if not isinstance(s, Sharded) or s.window is not None or s.inner != 1:
        return "into a value that is not sharded whole along the sequence"
    full = _expand_ellipsis(index if isinstance(index, tuple) else (index,), len(global_shape(dst)))
    if full is None or any(isinstance(i, fx.Node) for i in full):
        return "with tensor indices"
    at, seq_at = seq_entry(full, s.dim)
    if at is not None and not _covers(full[at], global_shape(dst)[s.dim], em.ctx.seq_sym is not None):
        return "at some positions of the sequence only"
    view = fake_value(dst)[tuple(full)]  # (global shapes) the written view
    return _value_refusal(em, value, seq_at, view.dim(), s.chunk)


def _value_refusal(em: Emitter, value: Any, seq_at: int, ndim: int, chunk: int) -> Optional[str]:
    """Why ``value`` cannot be written into this rank's positions of a view whose sequence dim is
    ``seq_at`` (of ``ndim`` dims), or None."""
    lay = em.layout(value)
    if isinstance(lay, Sharded):
        v = fake_value(value)
        aligned = lay.dim + ndim - v.dim()  # broadcasting aligns trailing dims
        if lay.window is None and lay.inner == 1 and lay.chunk == chunk and aligned == seq_at:
            return None
        return "of a value sharded along another dim"
    v = fake_value(value) if isinstance(value, fx.Node) else value
    if not isinstance(v, torch.Tensor):
        return None  # a Python number
    at = seq_at - (ndim - v.dim())
    if at < 0 or v.shape[at] == 1:
        return None  # broadcast along the sequence
    return "of a whole value that varies along the sequence"


__all__ = ["setitem"]
