"""A value gathered to the whole sequence behaves as the one-process value: it can be written into
and viewed (graph_ops.gather_seq returns a fresh row-major tensor).

Hugging Face Qwen3-Next's chunked delta rule writes into a gathered buffer (``out[:, :, i] = ...``:
autograd refused to write into a view made inside the gather), and Qwen4's code views a gathered
value that was laid out with the sequence moved (``view`` refused its strides). Exact on 2 ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import grad_errors, loss_through_ring_cp, rel, twin_models

S, D = 16, 8


class WritesIntoGathered(nn.Module):
    """A running sum of chunks written into a buffer along the sequence (gathered: it mixes tokens),
    then a view of the result, then attention."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.qkv = nn.Linear(D, D), nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).transpose(1, 2)  # (B, D, S): the sequence last, as a (B, C, S) layout
        out = torch.zeros_like(h)
        for i in range(0, S, 4):  # chunk i reads chunk i - 4: a scan over the sequence
            prev = out[:, :, i - 4:i] if i else 0.0
            out[:, :, i:i + 4] = h[:, :, i:i + 4] + prev
        h = out.view(x.shape[0], 2, D // 2, S).flatten(1, 2).transpose(1, 2)  # (B, S, D)
        q, k, v = self.qkv(h).view(x.shape[0], S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def _compare() -> dict:
    ref_model, cp_model = twin_models(WritesIntoGathered)
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(1))
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,))  # also: every attention the ring
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": len(backend.fallbacks)}


def test_write_into_and_view_of_gathered_values_are_exact(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _compare, timeout=240)):
        assert r["loss"] <= 1e-5 and max(r["grads"].values()) <= 1e-5, (rank, r)
        assert r["fallbacks"] >= 1, (rank, r)  # the scan is gathered (warned), then exact
