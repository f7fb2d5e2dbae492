"""The ring loops: forward and backward of exact attention over CP shards.

Both iterate the K/V blocks in ring order (:func:`.comm.kv_blocks`), compute the
rectangles the plan lists for each step (:mod:`.plan`) with the block kernel, and
keep everything numerically important in fp32: the forward merges each rectangle's
(out, lse) into fp32 accumulators; the backward uses the *global* out and lse,
accumulates dQ locally and hands each block's dK/dV to a :class:`.comm.GradSink`.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._group import CPGroup
from ..kernels import BlockKernel
from .comm import GradSink, kv_blocks
from .merge import accumulator_dtype, empty_partial, merge_
from .plan import step_segments

Tensor = torch.Tensor


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
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries over the whole sequence.

    q: (B, H, c, D); k, v: (B, H_kv, c, D) -> out (B, H, c, D) in q.dtype,
    lse (B, H, c) float32 (float64 for float64 inputs).
    """
    c = q.shape[2]
    acc_out, acc_lse = empty_partial(q)  # (B, H, c, D), (B, H, c)
    kv = torch.stack([k, v])  # (2, B, H_kv, c, D): one buffer travels
    for _, src, kv_src in kv_blocks(kv, group, rotate):
        k_src, v_src = kv_src[0], kv_src[1]
        for seg in step_segments(load_balance, causal, group.size, group.rank, src, c):
            out, lse = kernel.forward(q[:, :, seg.q], k_src[:, :, seg.k], v_src[:, :, seg.k], causal=seg.causal, scale=scale)
            merge_(acc_out[:, :, seg.q], acc_lse[:, :, seg.q], out, lse)
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
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards, each in its input's dtype.

    dout, q, out: (B, H, c, D); k, v: (B, H_kv, c, D); lse: (B, H, c), the global one.
    """
    c = q.shape[2]
    acc_dt = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)  # (B, H, c, D), stays local
    kv = torch.stack([k, v])  # (2, B, H_kv, c, D)
    sink = GradSink(kv.shape, acc_dt, kv.device, group, rotate)
    for step, src, kv_src in kv_blocks(kv, group, rotate):
        k_src, v_src = kv_src[0], kv_src[1]
        dkv = torch.zeros(kv.shape, dtype=acc_dt, device=kv.device)  # this rank's share of block src's grads
        for seg in step_segments(load_balance, causal, group.size, group.rank, src, c):
            dq_s, dk_s, dv_s = kernel.backward(
                dout[:, :, seg.q], q[:, :, seg.q], k_src[:, :, seg.k], v_src[:, :, seg.k],
                out[:, :, seg.q], lse[:, :, seg.q], causal=seg.causal, scale=scale,
            )
            dq[:, :, seg.q] += dq_s
            dkv[0][:, :, seg.k] += dk_s
            dkv[1][:, :, seg.k] += dv_s
        sink.add(step, src, dkv)
    dkv_own = sink.finish()  # (2, B, H_kv, c, D): every rank's contribution to this rank's K/V
    # dK and dV are views of one buffer: copy them apart (custom-op outputs must not alias).
    return dq.to(q.dtype), dkv_own[0].to(k.dtype, copy=True), dkv_own[1].to(v.dtype, copy=True)
