"""Reference block kernel: plain PyTorch math in float32 (float64 for float64 inputs).

Materialises the (Lq, Lk) score matrix of one block, so it is for tests and small
shapes, not production. Any device. GQA is handled by viewing the query heads as
(H_kv, group) rather than repeating K/V.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q: Tensor, h_kv: int) -> Tensor:
    b, h, lq, d = q.shape
    return q.reshape(b, h_kv, h // h_kv, lq, d)  # (B, H_kv, G, Lq, D)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, mask: Optional[Tensor] = None) -> Tensor:
    """Masked scores (B, H_kv, G, Lq, Lk) in the compute dtype; ``mask`` additive, (B|1, H|1, Lq, Lk)."""
    ct = _compute_dtype(q.dtype)
    s = torch.einsum("bngqd,bnkd->bngqk", _grouped(q.to(ct), k.shape[1]), k.to(ct)) * scale
    if mask is not None:
        b, h_kv, g, lq, lk = s.shape
        s = s + mask.to(ct).expand(b, h_kv * g, lq, lk).reshape(b, h_kv, g, lq, lk)
    if causal:
        lq, lk = s.shape[-2:]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    return s


class ReferenceKernel:
    """Exact, simple, O(Lq*Lk) memory. See :mod:`cp_compile.kernels.base` for the contract."""

    name = "reference"
    supports_masks = True
    fuses_merge = False

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype) -> str:
        """Why :meth:`supports` said no, and the fix."""
        return f"the reference kernel takes floating-point q/k/v, not {dtype}. Fix: cast q/k/v to float32."

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        b, h, lq, d = q.shape
        s = _scores(q, k, causal, scale, mask)  # (B, H_kv, G, Lq, Lk)
        lse = torch.logsumexp(s, dim=-1)  # (B, H_kv, G, Lq)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - safe.unsqueeze(-1))  # rows with no key: exp(-inf) = 0
        out = torch.einsum("bngqk,bnkd->bngqd", p, v.to(p.dtype))
        return out.reshape(b, h, lq, d), lse.reshape(b, h, lq)

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
        h_kv = k.shape[1]
        s = _scores(q, k, causal, scale, mask)
        ct = s.dtype
        lse_g = _grouped(lse.to(ct).unsqueeze(-1), h_kv)  # (B, H_kv, G, Lq, 1)
        safe = torch.where(torch.isneginf(lse_g), torch.zeros_like(lse_g), lse_g)
        p = torch.exp(s - safe)  # (B, H_kv, G, Lq, Lk): probabilities under the global lse
        do = _grouped(dout.to(ct), h_kv)
        o = _grouped(out.to(ct), h_kv)
        dv = torch.einsum("bngqk,bngqd->bnkd", p, do)
        dp = torch.einsum("bngqd,bnkd->bngqk", do, v.to(ct))
        delta = (do * o).sum(-1, keepdim=True)  # D = rowsum(dO * O), global
        ds = p * (dp - delta) * scale
        dq = torch.einsum("bngqk,bnkd->bngqd", ds, k.to(ct)).reshape(q.shape)
        dk = torch.einsum("bngqk,bngqd->bnkd", ds, _grouped(q.to(ct), h_kv))
        return dq, dk, dv
