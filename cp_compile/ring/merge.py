"""Exact merge of partial attention results ``(out, lse)`` (docs/design.md §1).

Two partial results over disjoint key sets combine as
``lse = logaddexp(lse_1, lse_2)``, ``out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2``.
The merge is associative and commutative. Accumulators are float32 (float64 for
float64 inputs) whatever the input dtype; a row that has seen no key has lse = -inf
and out = 0, and merging two such rows stays (0, -inf), never NaN.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs are merged in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_partial(q: Tensor) -> tuple[Tensor, Tensor]:
    """The merge identity for queries ``q`` (B, H, L, D): out zeros, lse -inf (B, H, L)."""
    dt = accumulator_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=dt, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dt, device=q.device)
    return out, lse


def merge_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge the partial ``(out, lse)`` into the accumulators in place.

    acc_out: (B, H, L, D) accumulator dtype; acc_lse: (B, H, L); out: (B, H, L, D) any
    float dtype; lse: (B, H, L). The accumulators may be views (row slices).
    """
    lse = lse.to(acc_lse.dtype)
    new_lse = torch.logaddexp(acc_lse, lse)
    # Rows still without any key: keep the exponent finite so exp(-inf - 0) = 0, not NaN.
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_acc = torch.exp(acc_lse - ref).unsqueeze(-1)  # (B, H, L, 1)
    w_new = torch.exp(lse - ref).unsqueeze(-1)
    acc_out.mul_(w_acc).addcmul_(out, w_new)  # no (B, H, L, D) temporary
    acc_lse.copy_(new_lse)
