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

from typing import Iterator, Optional, Tuple

import torch

from ..group import CPGroup
from ..kernels import BlockKernel
from .comm import GradSink, kv_blocks
from .fused import ring_backward_fused, ring_forward_fused
from .masking import BlockPositions, MaskSpec, fix_dead_rows, segment_call
from .merge import accumulator_dtype, empty_partial, merge_
from .plan import ALL, Segment, step_segments

Tensor = torch.Tensor


def _accumulate(acc: Optional[Tensor], rows: slice, part: Tensor, like: Tensor, dtype: torch.dtype) -> Tensor:
    """acc[rows] += part, creating acc (shaped like ``like``) on first use without a zero fill if possible."""
    if acc is None:
        if rows == ALL:
            return part.to(dtype).contiguous()  # the first full contribution *is* the accumulator
        acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    acc[:, :, rows] += part
    return acc


def _calls(spec: MaskSpec, load_balance: str, causal: bool, group: CPGroup, src: int, c: int, valid_len: int,
           pos: BlockPositions) -> Iterator[Tuple[Segment, bool, Optional[Tensor]]]:
    """(rectangle, causal, additive mask or None) of every kernel call against block ``src``.

    The plan's rectangles (``valid_len`` >= 0: global positions from there on are
    padding, never attended), refined by a window or explicit mask (:mod:`.masking`).
    """
    valid = pos.valid_keys(src, valid_len)
    for seg in step_segments(load_balance, causal, group.size, group.rank, src, c, valid):
        call = segment_call(spec, seg, pos(group.rank), pos(src)) if spec.active else (seg.causal, None)
        if call is not None:
            yield (seg, *call)


def _mask_kw(mask: Optional[Tensor]) -> dict:
    return {} if mask is None else {"mask": mask}


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
    spec: MaskSpec = MaskSpec(),
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries over the whole sequence.

    q: (B, H, c, D); k, v: (B, H_kv, c, D) -> out (B, H, c, D) in q.dtype,
    lse (B, H, c) float32 (float64 for float64 inputs).
    """
    if getattr(kernel, "fuses_merge", False):
        return ring_forward_fused(q, k, v, causal=causal, scale=scale, group=group, load_balance=load_balance,
                                  rotate=rotate, kernel=kernel, valid_len=valid_len, spec=spec)
    c, acc_dt = q.shape[2], accumulator_dtype(q.dtype)
    pos = BlockPositions(c, group, load_balance, q.device)
    acc_out: Optional[Tensor] = None  # (B, H, c, D) acc_dt
    acc_lse: Optional[Tensor] = None  # (B, H, c) acc_dt
    for _, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        for seg, seg_causal, mask in _calls(spec, load_balance, causal, group, src, c, valid_len, pos):
            out, lse = kernel.forward(q[:, :, seg.q], k_src[:, :, seg.k], v_src[:, :, seg.k], causal=seg_causal,
                                      scale=scale, **_mask_kw(mask))
            if mask is not None:
                out, lse = fix_dead_rows(out, lse, mask)
            if acc_out is None and seg.q == ALL:  # the first full-row result is the accumulator
                acc_out, acc_lse = out.to(acc_dt).contiguous(), lse.to(acc_dt).contiguous()
                continue
            if acc_out is None:
                acc_out, acc_lse = empty_partial(q)
            merge_(acc_out[:, :, seg.q], acc_lse[:, :, seg.q], out, lse)
    if acc_out is None:  # an explicit mask hid every key from every row
        acc_out, acc_lse = empty_partial(q)
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
    spec: MaskSpec = MaskSpec(),
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards, each in its input's dtype.

    dout, q, out: (B, H, c, D); k, v: (B, H_kv, c, D); lse: (B, H, c), the global one.
    """
    if getattr(kernel, "fuses_merge", False):
        return ring_backward_fused(dout, q, k, v, out, lse, causal=causal, scale=scale, group=group,
                                   load_balance=load_balance, rotate=rotate, kernel=kernel, valid_len=valid_len,
                                   spec=spec)
    c, acc_dt = q.shape[2], accumulator_dtype(q.dtype)
    pos = BlockPositions(c, group, load_balance, q.device)
    if spec.attn_mask is not None:  # rows that see no key at all: any finite lse gives P = 0 (and no NaN)
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)  # (B, H, c, D), stays local
    sink = GradSink(k, acc_dt, group, rotate)
    for step, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        dk_src: Optional[Tensor] = None  # this rank's share of block src's dK (B, H_kv, c, D)
        dv_src: Optional[Tensor] = None
        for seg, seg_causal, mask in _calls(spec, load_balance, causal, group, src, c, valid_len, pos):
            dq_s, dk_s, dv_s = kernel.backward(
                dout[:, :, seg.q], q[:, :, seg.q], k_src[:, :, seg.k], v_src[:, :, seg.k],
                out[:, :, seg.q], lse[:, :, seg.q], causal=seg_causal, scale=scale, **_mask_kw(mask),
            )
            dq[:, :, seg.q] += dq_s
            dk_src = _accumulate(dk_src, seg.k, dk_s, k, acc_dt)
            dv_src = _accumulate(dv_src, seg.k, dv_s, v, acc_dt)
        sink.add(step, src, dk_src, dv_src)
    dk, dv = sink.finish()  # every rank's contribution to this rank's K/V
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # custom-op outputs must not alias each other
    return dq, dk, dv
