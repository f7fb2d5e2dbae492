"""The local block-attention kernel interface the ring calls once per block pair.

A ring step attends this rank's queries to one visiting K/V block. The kernel sees
only a dense rectangle of it (the ring's plan has already cut away fully masked
parts), so its contract is small:

* ``forward(q, k, v, causal=, scale=) -> (out, lse)``
  q: (B, H, Lq, D); k, v: (B, H_kv, Lk, D) with H % H_kv == 0 (query head h reads
  K/V head h // (H / H_kv); a kernel must not require repeated K/V in memory from
  its caller). Lq >= 1 and Lk >= 1 always. ``causal`` is only ever requested with
  Lq == Lk and means query i sees keys 0..i. Returns out (B, H, Lq, D) in any float
  dtype (the ring merges in fp32) and lse (B, H, Lq) float32 (float64 for float64
  inputs), natural log.
* ``supports_masks``: when True, ``forward`` and ``backward`` also take ``mask=`` (additive,
  float, broadcastable to (B, H, Lq, Lk)), for explicit masks and windows;
  ``supports(device, dtype)`` and ``unsupported_reason(device, dtype)`` say where it runs.
* ``backward(dout, q, k, v, out, lse, causal=, scale=) -> (dq, dk, dv)``
  ``out`` and ``lse`` are the *global* (fully merged) attention output and
  log-sum-exp of these query rows, so the result is this block's exact contribution
  to the gradients. dq: (B, H, Lq, D); dk, dv: (B, H_kv, Lk, D), any float dtype.

Implementations: ``aten`` (:mod:`.aten`), ``reference`` (:mod:`.reference`),
``triton`` (:mod:`.triton`). Packed documents (``doc_ids``) need nothing more of a
block kernel: the ring splits each rectangle into equal-document calls, full or causal.
Rectangles with a ``score_mod`` run on :class:`.scores.ScoresKernel` (explicit scores,
not registered) whatever kernel is chosen; a ``mask_mod`` reaches the kernel as ``mask=``.

A kernel may also fuse the ring's merge: a :class:`StepKernel` (``fuses_merge =
True``) keeps the running softmax state in fp32 across ring steps and masks by
*global token positions* instead of the plan's rectangles, so the ring calls it once
per step on the whole visiting block (see :mod:`cp_compile.ring.fused`):

* ``new_state(q) -> state``; ``forward_step(q, k, v, state, q_pos, k_pos, causal=,
  scale=, kv_limit=)`` folds the block into ``state`` in place; ``finalize(state,
  dtype) -> (out, lse)``. Key j is visible to query i iff ``k_pos[j] < kv_limit``,
  ``q_pos[i] - k_pos[j] < window`` and, when causal, ``k_pos[j] <= q_pos[i]`` (positions
  int32, any order); the ring passes 2**31 - 1 for "no padding" and "no window". A kernel with
  ``supports_doc_ids = True`` also takes ``q_doc=`` (B|1, S_q) and ``k_doc=`` (B|1, S_k)
  int32 document ids, both or neither: key j is then visible only if also
  ``q_doc[b, i] == k_doc[b, j]``. The ring refuses ``mask_mod`` / ``score_mod`` on step
  kernels.
* ``delta(dout, out) -> rowsum(dout * out)`` (fp32, once per backward);
  ``backward_step(dout, q, k, v, lse, delta, (dq, dk, dv), q_pos, k_pos, causal=,
  scale=, kv_limit=)`` adds the block's contributions into fp32 accumulators.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch

Tensor = torch.Tensor


class BlockKernel(Protocol):
    """What a local block kernel provides: everything :mod:`cp_compile.ring` reads or calls
    on it (see the module docstring for the contract)."""

    name: str
    supports_masks: bool
    """Whether ``forward``/``backward`` take ``mask=``: an additive float mask broadcastable to
    (B, H, Lq, Lk), -inf where masked. The ring needs it for explicit masks and for sliding
    windows on plain block kernels; a kernel without it is refused there, naming a fix."""
    fuses_merge: bool
    """True for a :class:`StepKernel` (the ring then calls its step methods instead)."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this kernel runs on ``device`` with inputs of ``dtype``."""
        ...

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype) -> str:
        """Why ``supports`` is False, with the fix, for the error the ring raises."""
        ...

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(out, lse) of ``q`` attending to ``k``/``v`` (``mask=`` only if ``supports_masks``)."""
        ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv): this block's contribution given the global ``out`` and ``lse``."""
        ...


class StepKernel(BlockKernel, Protocol):
    """A block kernel that also fuses the ring merge (see the module docstring)."""

    fuses_merge: bool

    def new_state(self, q: Tensor) -> Tuple[Tensor, ...]:
        """The empty running state for queries ``q`` (B, H, S_q, D)."""
        ...

    def forward_step(self, q: Tensor, k: Tensor, v: Tensor, state: Tuple[Tensor, ...], q_pos: Tensor,
                     k_pos: Tensor, *, causal: bool, scale: float, kv_limit: int, window: int = 2**31 - 1,
                     q_doc: Optional[Tensor] = None, k_doc: Optional[Tensor] = None) -> None:
        """Fold ``q`` attending to ``k``/``v`` (masked by position) into ``state`` in place; query i
        sees only keys with ``q_pos[i] - k_pos[j] < window`` (2**31 - 1: no window)."""
        ...

    def finalize(self, state: Tuple[Tensor, ...], dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """(out in ``dtype``, lse float32) from a running state."""
        ...

    def delta(self, dout: Tensor, out: Tensor) -> Tensor:
        """rowsum(dout * out) (B, H, S_q) float32."""
        ...

    def backward_step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                      grads: Tuple[Tensor, Tensor, Tensor], q_pos: Tensor, k_pos: Tensor, *,
                      causal: bool, scale: float, kv_limit: int, window: int = 2**31 - 1,
                      q_doc: Optional[Tensor] = None, k_doc: Optional[Tensor] = None) -> None:
        """Add this block's (dq, dk, dv) into the fp32 accumulators ``grads`` in place (mask as in
        :meth:`forward_step`)."""
        ...
