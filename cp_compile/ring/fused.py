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

Steps the plan lists as fully masked are not launched at all; inside a launched
step the kernel skips the masked tiles itself.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .._group import CPGroup
from ..layout import rank_positions
from .comm import GradSink, kv_blocks
from .plan import step_segments

Tensor = torch.Tensor
NO_LIMIT = 2**31 - 1  # no padding: every key position is below this


class _Positions:
    """Global positions (int32, on the device) of every rank's block, computed once."""

    def __init__(self, c: int, group: CPGroup, load_balance: str, device: torch.device) -> None:
        self.c, self.group, self.load_balance, self.device = c, group, load_balance, device
        self._cache: dict = {}

    def __call__(self, rank: int) -> Tensor:
        if rank not in self._cache:
            pos = rank_positions(self.c * self.group.size, self.group.size, rank, self.load_balance)
            self._cache[rank] = pos.to(device=self.device, dtype=torch.int32)  # (c,)
        return self._cache[rank]


def _step_runs(load_balance: str, causal: bool, group: CPGroup, src: int, c: int, valid_len: int, pos: _Positions) -> bool:
    """Whether any (query, key) pair of the step against block ``src`` is visible."""
    valid = None if valid_len < 0 else int((pos(src) < valid_len).sum())
    return bool(step_segments(load_balance, causal, group.size, group.rank, src, c, valid))


def ring_forward_fused(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, group: CPGroup,
                       load_balance: str, rotate: str, kernel, valid_len: int = -1) -> Tuple[Tensor, Tensor]:
    """(out (B, H, c, D) in q.dtype, lse (B, H, c) fp32); arguments as :func:`.loops.ring_forward`."""
    c = q.shape[2]
    pos = _Positions(c, group, load_balance, q.device)
    limit = valid_len if valid_len >= 0 else NO_LIMIT
    state = kernel.new_state(q)
    for _, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        if _step_runs(load_balance, causal, group, src, c, valid_len, pos):
            kernel.forward_step(q, k_src, v_src, state, pos(group.rank), pos(src), causal=causal, scale=scale,
                                kv_limit=limit)
    return kernel.finalize(state, q.dtype)


def ring_backward_fused(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                        causal: bool, scale: float, group: CPGroup, load_balance: str, rotate: str, kernel,
                        valid_len: int = -1) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shards in their input dtypes; arguments as :func:`.loops.ring_backward`."""
    c = q.shape[2]
    pos = _Positions(c, group, load_balance, q.device)
    limit = valid_len if valid_len >= 0 else NO_LIMIT
    dlt = kernel.delta(dout, out)  # (B, H, c) fp32
    lse = lse.float().contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, c, D), stays local
    sink = GradSink(k, torch.float32, group, rotate)
    for step, src, k_src, v_src in kv_blocks(k, v, group, rotate):
        if not _step_runs(load_balance, causal, group, src, c, valid_len, pos):
            sink.add(step, src, None, None)
            continue
        dk_src = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # (B, H_kv, c, D)
        dv_src = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        kernel.backward_step(dout, q, k_src, v_src, lse, dlt, (dq, dk_src, dv_src), pos(group.rank), pos(src),
                             causal=causal, scale=scale, kv_limit=limit)
        sink.add(step, src, dk_src, dv_src)
    dk, dv = sink.finish()
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()  # custom-op outputs must not alias each other
    return dq, dk, dv
