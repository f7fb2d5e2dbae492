"""The ring loops: forward and backward of exact attention over CP shards.

Both iterate the K/V blocks in ring order (:func:`.comm.kv_blocks`), compute the
calls :func:`.calls.step_calls` lists for each step (the plan's rectangles, refined by
windows, masks, documents and mods) with the block kernel (or, for a ``score_mod``,
:class:`cp_compile.kernels.scores.ScoresKernel`, which also gives the gradient of learned score buffers), and
keep everything numerically important in fp32: the forward merges each rectangle's
(out, lse) into fp32 accumulators; the backward uses the *global* out and lse,
accumulates dQ locally and hands each block's dK/dV to a :class:`.comm.GradSink`.
Kernels that fuse the merge (``fuses_merge``, e.g. the Triton ones) take the loops
of :mod:`.fused` instead, except for a backward with learned score buffers, which stays here
(explicit scores: the Triton step kernels give no gradient of a score_mod's buffers).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..group import CPGroup
from ..kernels import BlockKernel
from ..kernels.scores import SCORES
from .calls import Call, step_calls
from .comm import GradSink, kv_blocks
from .documents import DocIndex
from .fused import ring_backward_fused, ring_forward_fused
from .masking import BlockPositions, MaskSpec, fix_dead_rows
from .merge import accumulator_dtype, empty_partial, merge_
from .plan import ALL

Tensor = torch.Tensor


def _accumulate(acc: Optional[Tensor], call: Call, part: Tensor, like: Tensor, dtype: torch.dtype) -> Tensor:
    """acc[b, :, k rows] += part, creating acc (shaped like ``like``) on first use without a zero fill if possible."""
    if acc is None:
        if call.k == ALL and call.b == ALL:
            return part.to(dtype).contiguous()  # the first full contribution *is* the accumulator
        acc = torch.zeros(like.shape, dtype=dtype, device=like.device)
    acc[call.b, :, call.k] += part
    return acc


def _doc_index(spec: MaskSpec, seq_len: int, valid_len: int, batch: int) -> Optional[DocIndex]:
    """The call's document ids (None without), checked against the batch and global length."""
    if spec.doc_ids is None:
        return None
    ids = spec.doc_ids
    n, rows = ids.shape[-1], ids.shape[0] if ids.dim() == 2 else 1
    if ids.dim() not in (1, 2) or rows not in (1, batch) or ids.dtype not in (torch.int32, torch.int64) or not (
            n == seq_len or 0 <= valid_len <= n < seq_len):
        raise ValueError(
            f"cp_compile: doc_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}; the ring takes int32/int64 ids "
            f"of every global position, (B={batch} or 1, S={seq_len}). Fix: pass the whole sequence's document ids "
            "(not this rank's shard), e.g. cp_compile.doc_ids_from_cu_seqlens(cu_seqlens, S)."
        )
    return DocIndex(ids, seq_len)


def _forward_call(kernel: BlockKernel, call: Call, q: Tensor, k: Tensor, v: Tensor, scale: float):
    """(out, lse) of one call; rows that see nothing in it get (0, -inf)."""
    qc, kc, vc = q[call.b, :, call.q], k[call.b, :, call.k], v[call.b, :, call.k]
    if call.score is not None:
        out, lse = SCORES.forward(qc, kc, vc, causal=call.causal, scale=scale, score=call.score, mask=call.mask)
    else:
        out, lse = kernel.forward(qc, kc, vc, causal=call.causal, scale=scale, **_mask_kw(call.mask))
    return (out, lse) if call.mask is None else fix_dead_rows(out, lse, call.mask)


def _backward_call(kernel: BlockKernel, call: Call, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   lse: Tensor, scale: float, dq: Tensor):
    """(dq, dk, dv) of one call, given the global out and lse. The score kernel adds its dq into the
    accumulator ``dq`` (B, H, c, D) itself, tile by tile, and gives None for it: no (B, H, Lq, D) block
    result beside the accumulator at the backward's peak."""
    rows = (call.b, slice(None), call.q)
    args = (dout[rows], q[rows], k[call.b, :, call.k], v[call.b, :, call.k], out[rows], lse[call.b, :, call.q])
    if call.score is not None:
        return SCORES.backward(*args, causal=call.causal, scale=scale, score=call.score, mask=call.mask,
                               dq_acc=dq[rows])
    return kernel.backward(*args, causal=call.causal, scale=scale, **_mask_kw(call.mask))


class _LocalSink:
    """dK/dV without a process group (one process: the only block is this rank's own)."""

    def __init__(self, like: Tensor, dtype: torch.dtype) -> None:
        self.dk = self.dv = torch.zeros(like.shape, dtype=dtype, device=like.device)

    def add(self, step: int, src: int, dk: Optional[Tensor], dv: Optional[Tensor]) -> None:
        if dk is not None:
            self.dk, self.dv = dk, dv

    def finish(self) -> Tuple[Tensor, Tensor]:
        return self.dk, self.dv


def learned_buffers(spec: MaskSpec) -> bool:
    """Whether the call's score_mod has buffers whose gradient the backward computes."""
    return spec.mods is not None and bool(getattr(spec.mods, "learned", ()))


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
    positions: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries over the whole sequence.

    q: (B, H, c, D); k, v: (B, H_kv, c, D) -> out (B, H, c, D) in q.dtype,
    lse (B, H, c) float32 (float64 for float64 inputs). ``positions``: (N, c) int64 table of
    every rank's global positions (checked by the caller), in place of ``load_balance``.
    """
    if getattr(kernel, "fuses_merge", False):
        return ring_forward_fused(q, k, v, causal=causal, scale=scale, group=group, load_balance=load_balance,
                                  rotate=rotate, kernel=kernel, valid_len=valid_len, spec=spec, positions=positions)
    c, acc_dt = q.shape[2], accumulator_dtype(q.dtype)
    pos = BlockPositions(c, group, load_balance, q.device, positions)
    docs = _doc_index(spec, c * group.size, valid_len, q.shape[0])
    acc_out: Optional[Tensor] = None  # (B, H, c, D) acc_dt
    acc_lse: Optional[Tensor] = None  # (B, H, c) acc_dt
    for _, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        for call in step_calls(spec, docs, causal, group, src, c, valid_len, pos, q.shape[:2]):
            out, lse = _forward_call(kernel, call, q, k_src, v_src, scale)
            if acc_out is None and call.q == ALL and call.b == ALL:  # the first full-row result is the accumulator
                acc_out, acc_lse = out.to(acc_dt).contiguous(), lse.to(acc_dt).contiguous()
                continue
            if acc_out is None:
                acc_out, acc_lse = empty_partial(q)
            merge_(acc_out[call.b, :, call.q], acc_lse[call.b, :, call.q], out, lse)
    if acc_out is None:  # the masks hid every key from every row
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
    positions: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards, each in its input's dtype.

    dout, q, out: (B, H, c, D); k, v: (B, H_kv, c, D); lse: (B, H, c), the global one;
    ``positions`` as in :func:`ring_forward`. Learned score buffers (``spec.mods.learned``): every
    rectangle runs on the explicit-scores kernel, whatever ``kernel`` (a fused one too), and adds its
    d(loss)/d(buffer) into ``spec.mods.grads``: this rank's share (its queries' rectangles).
    """
    if getattr(kernel, "fuses_merge", False) and not learned_buffers(spec):
        return ring_backward_fused(dout, q, k, v, out, lse, causal=causal, scale=scale, group=group,
                                   load_balance=load_balance, rotate=rotate, kernel=kernel, valid_len=valid_len,
                                   spec=spec, positions=positions)
    c, acc_dt = q.shape[2], accumulator_dtype(q.dtype)
    pos = BlockPositions(c, group, load_balance, q.device, positions)
    docs = _doc_index(spec, c * group.size, valid_len, q.shape[0])
    if spec.active:  # rows that see no key at all: any finite lse gives P = 0 (and no NaN)
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)  # (B, H, c, D), stays local
    sink = GradSink(k, acc_dt, group, rotate) if group.pg is not None else _LocalSink(k, acc_dt)
    for step, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        dk_src: Optional[Tensor] = None  # this rank's share of block src's dK (B, H_kv, c, D)
        dv_src: Optional[Tensor] = None
        for call in step_calls(spec, docs, causal, group, src, c, valid_len, pos, q.shape[:2]):
            dq_s, dk_s, dv_s = _backward_call(kernel, call, dout, q, k_src, v_src, out, lse, scale, dq)
            if dq_s is not None:
                dq[call.b, :, call.q] += dq_s
            dk_src = _accumulate(dk_src, call, dk_s, k, acc_dt)
            dv_src = _accumulate(dv_src, call, dv_s, v, acc_dt)
        sink.add(step, src, dk_src, dv_src)
    dk, dv = sink.finish()  # every rank's contribution to this rank's K/V
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # custom-op outputs must not alias each other
    return dq, dk, dv
