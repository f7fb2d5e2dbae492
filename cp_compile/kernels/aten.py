"""aten block kernel: PyTorch's fused flash-attention ops, which return the lse.

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): any
  float dtype, GQA natively, natural-log lse (float32; float64 for float64 inputs).
  Known traps, both kept away by the ring's plan: a fully masked row returns lse = 0
  instead of -inf, and an empty key block kills the process (SIGFPE).
* CUDA: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``), fp16/bf16.
  That op wants equal head counts, so GQA expands K/V *locally* (a view for the
  forward; the backward sums the group). Only the H_kv heads travel the ring.
  Not exercised by CI (no GPU there); the Triton kernels are the intended default.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor
_aten = torch.ops.aten


def _check_nonempty(q: Tensor, k: Tensor) -> None:
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise RuntimeError(
            "cp_compile internal error: the aten block kernel was asked for an empty block "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)}); the CPU flash op would crash. "
            "Please report this with the ring options used."
        )


def _cpu_mask(mask: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """The CPU flash op wants an additive mask of q's dtype, (B|1, H|1, Lq, Lk)."""
    return None if mask is None else mask.to(q.dtype)


def _no_cuda_mask(mask: Optional[Tensor]) -> None:
    if mask is not None:
        raise ValueError(
            "cp_compile: the aten kernel's CUDA flash op takes no mask. Fix: for a sliding window use "
            "kernel='triton'; explicit attn_mask tensors run on CPU (kernel='aten') or kernel='reference'."
        )


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """(B, H_kv, L, D) -> (B, H, L, D) by repeating each K/V head for its query group."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_group(g: Tensor, h_kv: int) -> Tensor:
    """(B, H, L, D) gradient of expanded K/V -> (B, H_kv, L, D)."""
    b, h, n, d = g.shape
    return g.reshape(b, h_kv, h // h_kv, n, d).sum(2)


class AtenKernel:
    """Flash-attention block kernel on the aten ops. See :mod:`cp_compile.kernels.base`."""

    name = "aten"
    supports_masks = True  # on CPU; see _cpu_mask
    fuses_merge = False

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype) -> str:
        """Why :meth:`supports` said no, and the fix."""
        return (f"does not support {dtype} on {device.type} (it runs float32/float64/bfloat16/float16 on CPU, "
                "bfloat16/float16 on CUDA). Fix: use kernel='reference' (any device/dtype, slow) or cast q/k/v.")

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type == "cpu":
            return dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        if device.type == "cuda":
            return dtype in (torch.bfloat16, torch.float16)
        return False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        _check_nonempty(q, k)
        if q.device.type == "cpu":
            return _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, attn_mask=_cpu_mask(mask, q), scale=scale
            )
        _no_cuda_mask(mask)
        h = q.shape[1]
        res = _aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, h), _expand_kv(v, h), 0.0, causal, False, scale=scale
        )
        return res[0], res[1]

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
        _check_nonempty(q, k)
        out = out.to(q.dtype).contiguous()
        lse = lse.contiguous()
        if q.device.type == "cpu":
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=_cpu_mask(mask, q), scale=scale
            )
        _no_cuda_mask(mask)
        return self._cuda_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

    @staticmethod
    def _cuda_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
        h, h_kv = q.shape[1], k.shape[1]
        lq, lk = q.shape[2], k.shape[2]
        ke, ve = _expand_kv(k, h).contiguous(), _expand_kv(v, h).contiguous()
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, ke, ve, out, lse, empty, empty, lq, lk, 0.0, causal,
            empty, empty, scale=scale,
        )
        return dq, _sum_group(dk, h_kv), _sum_group(dv, h_kv)
