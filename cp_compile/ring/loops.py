"""The ring loops: forward and backward of exact attention over CP shards.

Both iterate the K/V blocks in ring order (:func:`.comm.kv_blocks`), compute the
rectangles the plan lists for each step (:mod:`.plan`) with the block kernel, and
keep everything numerically important in fp32: the forward merges each rectangle's
(out, lse) into fp32 accumulators; the backward uses the *global* out and lse,
accumulates dQ locally and hands each block's dK/dV to a :class:`.comm.GradSink`.
Kernels that fuse the merge (``fuses_merge``, e.g. the Triton ones) take the loops
of :mod:`.fused` instead.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._group import CPGroup
from ..kernels import BlockKernel
from .comm import GradSink, kv_blocks
from .fused import ring_backward_fused, ring_forward_fused
from .merge import accumulator_dtype, empty_partial, merge_
from ..layout import rank_positions
from .plan import ALL, step_segments

Tensor = torch.Tensor


def _accumulate(acc: Optional[Tensor], rows: slice, part: Tensor, like: Tensor, dtype: torch.dtype) -> Tensor:
    """acc[rows] += part, creating acc (shaped like ``like``) on first use without a zero fill if possible."""
    if acc is None:
        if rows == ALL:
            return part.to(dtype).contiguous()  # the first full contribution *is* the accumulator
        acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    acc[:, :, rows] += part
    return acc


def _segments(load_balance: str, causal: bool, group: CPGroup, src: int, c: int, valid_len: int):
    """The plan's rectangles for block ``src``; ``valid_len`` >= 0 marks global positions
    from ``valid_len`` on as padding (keys never attended)."""
    valid = None
    if valid_len >= 0:
        pos = rank_positions(c * group.size, group.size, src, load_balance)
        valid = int((pos < valid_len).sum())
    return step_segments(load_balance, causal, group.size, group.rank, src, c, valid)


def ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    group: CPGroup,
    load_balance: str,
    rotate: str,
    kernel: BlockKernel,
    valid_len: int = -1,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries over the whole sequence.

    q: (B, H, c, D); k, v: (B, H_kv, c, D) -> out (B, H, c, D) in q.dtype,
    lse (B, H, c) float32 (float64 for float64 inputs).
    """
    if getattr(kernel, "fuses_merge", False):
        return ring_forward_fused(q, k, v, causal=causal, scale=scale, group=group, load_balance=load_balance,
                                  rotate=rotate, kernel=kernel, valid_len=valid_len)
    c, acc_dt = q.shape[2], accumulator_dtype(q.dtype)
    acc_out: Optional[Tensor] = None  # (B, H, c, D) acc_dt
    acc_lse: Optional[Tensor] = None  # (B, H, c) acc_dt
    for _, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        for seg in _segments(load_balance, causal, group, src, c, valid_len):
            out, lse = kernel.forward(q[:, :, seg.q], k_src[:, :, seg.k], v_src[:, :, seg.k], causal=seg.causal, scale=scale)
            if acc_out is None and seg.q == ALL:  # step 0 always covers every row
                acc_out, acc_lse = out.to(acc_dt).contiguous(), lse.to(acc_dt).contiguous()
                continue
            if acc_out is None:
                acc_out, acc_lse = empty_partial(q)
            merge_(acc_out[:, :, seg.q], acc_lse[:, :, seg.q], out, lse)
    assert acc_out is not None and acc_lse is not None
    return acc_out.to(q.dtype), acc_lse


def ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    group: CPGroup,
    load_balance: str,
    rotate: str,
    kernel: BlockKernel,
    valid_len: int = -1,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards, each in its input's dtype.

    dout, q, out: (B, H, c, D); k, v: (B, H_kv, c, D); lse: (B, H, c), the global one.
    """
    if getattr(kernel, "fuses_merge", False):
        return ring_backward_fused(dout, q, k, v, out, lse, causal=causal, scale=scale, group=group,
                                   load_balance=load_balance, rotate=rotate, kernel=kernel, valid_len=valid_len)
    c, acc_dt = q.shape[2], accumulator_dtype(q.dtype)
    dq: Optional[Tensor] = None  # (B, H, c, D) acc_dt, stays local
    sink = GradSink(k, acc_dt, group, rotate)
    for step, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        dk_src: Optional[Tensor] = None  # this rank's share of block src's dK (B, H_kv, c, D)
        dv_src: Optional[Tensor] = None
        for seg in _segments(load_balance, causal, group, src, c, valid_len):
            dq_s, dk_s, dv_s = kernel.backward(
                dout[:, :, seg.q], q[:, :, seg.q], k_src[:, :, seg.k], v_src[:, :, seg.k],
                out[:, :, seg.q], lse[:, :, seg.q], causal=seg.causal, scale=scale,
            )
            dq = _accumulate(dq, seg.q, dq_s, q, acc_dt)
            dk_src = _accumulate(dk_src, seg.k, dk_s, k, acc_dt)
            dv_src = _accumulate(dv_src, seg.k, dv_s, v, acc_dt)
        sink.add(step, src, dk_src, dv_src)
    dk, dv = sink.finish()  # every rank's contribution to this rank's K/V
    assert dq is not None
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # custom-op outputs must not alias each other
    return dq, dk, dv
