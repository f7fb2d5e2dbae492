"""Model code written in styles the other tests never use (examples/model_styles.py) runs
context-parallel: exact, every attention the ring, no gather to the full sequence.

Distributed: loss and every parameter gradient within 1e-5 (relative) of one process on
the full sequence, at 2 and 4 ranks. Single process (``inspect``): the layout rules for
einsum, the complex views, ``torch.square`` and ``torch.rms_norm``, including the cases
that must still gather (the sequence letter summed over).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model_styles

from checks import grad_errors, loss_through_ring_cp, rel
from cp_compile.passes.propagate.rules.einsum import parse_equation

TOL = 1e-5
STYLES = [("llama3_complex_rope_factory", {}), ("llama3_complex_rope_factory", {"kv_heads": 4}),
          ("einsum_gpt_factory", {})]


def _compare(factory: str, kw: dict) -> dict:
    """On every rank: errors vs the eager full-sequence run, and what the rewritten graphs call."""
    ref_model, inputs = getattr(model_styles, factory)(**kw)
    cp_model, _ = getattr(model_styles, factory)(**kw)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs)
    targets = [str(n.target) for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "loss": rel(out.detach(), ref.detach()),
        "grad": max(grad_errors(cp_model, ref_model).values()),
        "fallbacks": list(backend.fallbacks),
        "ring": sum("ring_attention_fwd" in t for t in targets),
        "sdpa": sum("scaled_dot_product_attention" in t for t in targets),
        "layers": len(getattr(cp_model, "layers", getattr(cp_model, "blocks", []))),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("factory,kw", STYLES)
def test_style_is_exact_ring_only_and_gather_free(ranks, factory, kw, world):
    for rank, r in enumerate(ranks.run(world, _compare, factory, kw, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["fallbacks"] == [], (rank, r["fallbacks"])
        assert r["ring"] == r["layers"] == 2 and r["sdpa"] == 0, (rank, r)


# ------------------------------------------------------------------- single process rules
@pytest.mark.parametrize("eq,ndims,expected", [
    ("bsd,de->bse", [3, 2], (["bsd", "de"], "bse")),
    (" b s d , d e -> b s e ", [3, 2], (["bsd", "de"], "bse")),
    ("bsd,de", [3, 2], (["bsd", "de"], "bes")),  # implicit output: letters used once, sorted
    ("...d,de->...e", [3, 2], (["\u0100\u0101d", "de"], "\u0100\u0101e")),
    ("...sd,sd->...s", [4, 2], (["\u0100\u0101sd", "sd"], "\u0100\u0101s")),
    ("bsd,de->bse", [2, 2], None),  # ranks do not match
])
def test_parse_equation(eq, ndims, expected):
    assert parse_equation(eq, ndims) == expected


class _Probe(nn.Module):
    """Attention over (B, H, S, D) whose input x (B, S, H*D) first goes through ``op``."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.w = op, nn.Parameter(torch.randn(32, 32) / 6)
        self.pos = nn.Parameter(torch.randn(16, 32))  # (S, dim): one row per position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        y = self.op(self, x)  # (B, S, 32)
        q = y.view(B, S, 4, 8).transpose(1, 2)  # (B, H, S, D)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def _fallbacks(op) -> list:
    from cp_compile.tools.explain import explain_model

    torch.manual_seed(0)
    report = explain_model(_Probe(op), (torch.randn(2, 16, 32),), world_size=2)
    return [f.message for f in report.fallbacks]


PER_TOKEN_OPS = {
    "einsum_list_form_global_operand_indexed": lambda m, x: torch.einsum("bsd,sd->bsd", [x, m.pos]),
    "einsum_ellipsis_weight": lambda m, x: torch.einsum("...d,de->...e", x, m.w),
    "einsum_sequence_moves": lambda m, x: torch.einsum("bsd,de->sbe", x, m.w).transpose(0, 1),
    "complex_views": lambda m, x: torch.view_as_real(
        torch.view_as_complex(x.reshape(2, 16, 16, 2)) * torch.polar(torch.ones(16, 16), m.pos[:, :16])
    ).flatten(2),
    "polar_of_sharded_values": lambda m, x: torch.view_as_real(torch.polar(x.abs(), x)).sum(-1),
    "square_function_and_method": lambda m, x: torch.square(x) + x.square(),
    "torch_rms_norm": lambda m, x: torch.rms_norm(x, (32,), m.w[0], 1e-6),
}


@pytest.mark.parametrize("name", list(PER_TOKEN_OPS))
def test_per_token_op_does_not_gather(name):
    assert _fallbacks(PER_TOKEN_OPS[name]) == []


def test_einsum_summing_over_the_sequence_gathers_and_names_the_op():
    messages = _fallbacks(lambda m, x: x * torch.einsum("bsd,bse->bde", x, x).sum(-1, keepdim=True).transpose(1, 2))
    assert messages and any("einsum" in msg and "sums over the sequence letter" in msg for msg in messages), messages
