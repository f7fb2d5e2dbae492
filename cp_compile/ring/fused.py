"""The ring loops for kernels that fuse the merge (:class:`cp_compile.kernels.base.StepKernel`).

Same ring as :mod:`.loops` (same block order, same communication), but the kernel
sees each visiting block whole, with the global positions of this rank's queries
and of the block's keys, and keeps every accumulator in fp32 across steps:

* forward: ``state = new_state(q)``; per step ``forward_step(q, k_src, v_src, state,
  q_pos, k_pos)``; then ``finalize``. Nothing is rounded to the input dtype until
  the very end.
* backward: Δ once; per step ``backward_step`` adds into a local fp32 dQ and into a
  fresh fp32 dK/dV for the visiting block, which the :class:`.comm.GradSink` sends
  on to the block's owner.

Steps the plan lists as fully masked, or wholly outside a sliding window, are not
launched at all; inside a launched step the kernel skips the masked tiles itself.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..group import CPGroup
from .comm import GradSink, kv_blocks
from .masking import BlockPositions, MaskSpec, any_visible
from .plan import step_segments

Tensor = torch.Tensor
NO_LIMIT = 2**31 - 1  # no padding: every key position is below this


def _step_runs(load_balance: str, causal: bool, group: CPGroup, src: int, c: int, valid_len: int,
               pos: BlockPositions, window: int) -> bool:
    """Whether any (query, key) pair of the step against block ``src`` is visible."""
    valid = pos.valid_keys(src, valid_len)
    if not step_segments(load_balance, causal, group.size, group.rank, src, c, valid):
        return False
    return window <= 0 or any_visible(pos.cpu(group.rank), pos.cpu(src), window)


def _window(spec: MaskSpec) -> int:
    if spec.attn_mask is not None:
        raise ValueError(
            "cp_compile: the Triton kernels take no explicit attn_mask (they mask by position). "
            "Fix: use kernel='aten' (CPU) or 'reference', or express the mask as causal / a sliding window."
        )
    return spec.window if spec.window > 0 else NO_LIMIT


def ring_forward_fused(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, group: CPGroup,
                       load_balance: str, rotate: str, kernel, valid_len: int = -1,
                       spec: MaskSpec = MaskSpec()) -> Tuple[Tensor, Tensor]:
    """(out (B, H, c, D) in q.dtype, lse (B, H, c) fp32); arguments as :func:`.loops.ring_forward`."""
    c, window = q.shape[2], _window(spec)
    pos = BlockPositions(c, group, load_balance, q.device)
    limit = valid_len if valid_len >= 0 else NO_LIMIT
    state = kernel.new_state(q)
    for _, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        if _step_runs(load_balance, causal, group, src, c, valid_len, pos, spec.window):
            kernel.forward_step(q, k_src, v_src, state, pos(group.rank), pos(src), causal=causal, scale=scale,
                                kv_limit=limit, window=window)
    return kernel.finalize(state, q.dtype)


def ring_backward_fused(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                        causal: bool, scale: float, group: CPGroup, load_balance: str, rotate: str, kernel,
                        valid_len: int = -1, spec: MaskSpec = MaskSpec()) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards in their input dtypes; arguments as :func:`.loops.ring_backward`."""
    c, window = q.shape[2], _window(spec)
    pos = BlockPositions(c, group, load_balance, q.device)
    limit = valid_len if valid_len >= 0 else NO_LIMIT
    dlt = kernel.delta(dout, out)  # (B, H, c) fp32
    lse = lse.float().contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, c, D), stays local
    sink = GradSink(k, torch.float32, group, rotate)
    for step, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        if not _step_runs(load_balance, causal, group, src, c, valid_len, pos, spec.window):
            sink.add(step, src, None, None)
            continue
        dk_src = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # (B, H_kv, c, D)
        dv_src = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        kernel.backward_step(dout, q, k_src, v_src, lse, dlt, (dq, dk_src, dv_src), pos(group.rank), pos(src),
                             causal=causal, scale=scale, kv_limit=limit, window=window)
        sink.add(step, src, dk_src, dv_src)
    dk, dv = sink.finish()
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # custom-op outputs must not alias each other
    return dq, dk, dv
