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
* ``backward(dout, q, k, v, out, lse, causal=, scale=) -> (dq, dk, dv)``
  ``out`` and ``lse`` are the *global* (fully merged) attention output and
  log-sum-exp of these query rows, so the result is this block's exact contribution
  to the gradients. dq: (B, H, Lq, D); dk, dv: (B, H_kv, Lk, D), any float dtype.

Implementations: ``aten`` (:mod:`.aten`), ``reference`` (:mod:`.reference`); the
Triton kernels plug in by registering under ``"triton"``.
"""

from __future__ import annotations

from typing import Protocol, Tuple

import torch

Tensor = torch.Tensor


class BlockKernel(Protocol):
    """What a local block kernel provides (see the module docstring for the contract)."""

    name: str

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this kernel runs on ``device`` with inputs of ``dtype``."""
        ...

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
        """(out, lse) of ``q`` attending to ``k``/``v``."""
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
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv): this block's contribution given the global ``out`` and ``lse``."""
        ...
