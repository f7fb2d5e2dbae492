"""Attention ring_cp cannot split is never run whole in silence (docs/design.md §9).

``nn.MultiheadAttention`` whose attention weights (S x S) are used stays one opaque
``F.multi_head_attention_forward`` node (passes/expand_mha.py opens every other one into
SDPA), and hand-written attention ``softmax(q @ kᵀ) @ v`` whose S x S weights are used
elsewhere stays as written (passes/fuse_attention.py turns every other one into SDPA):
neither is ``scaled_dot_product_attention``, so the graph gets no context parallelism. Nor
does SDPA inside a control-flow body (``torch.cond``), which the passes do not enter
(activation-checkpointed regions they open: tests/test_checkpointed.py).
The backend says so with a WARNING naming the op, its source line and the fix (once per
line), ``strict=True`` refuses it, and ``cp-compile explain`` prints the same finding
from the same pass. The numbers stay the single-device ones.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

import cp_compile
from checks import cp_compile_warnings, explain_record

TOL = 1e-5


class WeightsUsed(nn.Module):
    """``nn.MultiheadAttention`` returning its averaged attention weights (B, S, S) too."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.mha(x, x, x)  # need_weights=True by default
        return out.square().mean() + weights.square().mean()


class ByHand(nn.Module):
    """One attention written as softmax(q @ kᵀ / √d) @ v, whose (B, S, S) weights are also
    regularised: they must exist, so it cannot become SDPA (fuse_attention leaves it)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, S, D) each
        weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)  # (B, S, S)
        return (weights @ v).square().mean() + weights.square().mean()


class Branching(nn.Module):
    """SDPA inside the branches of ``torch.cond``, which Dynamo keeps as a higher-order op with a
    body per branch (control flow: ring_cp opens checkpointed regions, not these)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    @staticmethod
    def attend(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, 2, -1).permute(2, 0, 3, 1, 4)  # (B, 2, S, 8) each
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        out = torch.cond(x.sum() > 0, self.attend, lambda t: self.attend(t * 2), (qkv,))
        return out.square().mean()


def _model(name: str):
    torch.manual_seed(0)
    model = {"nn.MultiheadAttention weights": WeightsUsed, "hand-written": ByHand,
             "torch.cond": Branching}[name]()
    return model, (torch.randn(2, 16, 16),)


def _run(name: str, strict: bool) -> dict:
    """On every rank: the warnings logged, the loss error against one process (or the refusal)."""
    (ref_model, inputs), (cp_model, _) = _model(name), _model(name)
    backend = cp_compile.RingCP(inner="aot_eager", strict=strict)
    with cp_compile_warnings() as warnings:
        try:
            out = torch.compile(cp_model, backend=backend)(*inputs)
        except Exception as e:  # Dynamo wraps backend errors
            return {"error": f"{type(e).__name__}: {e}"}
    # explain says what the runtime did; asked after it (its warnings, once per line, would come first)
    explained = explain_record(ref_model, inputs, world_size=2, strict=strict)
    assert backend.records == [explained], (backend.records, explained)
    ref = ref_model(*inputs)
    err = ((out.double() - ref.double()).abs() / ref.double().abs()).item()
    return {"warnings": warnings, "err": err}


NAMES = ["nn.MultiheadAttention weights", "hand-written", "torch.cond"]


@pytest.mark.parametrize("name", NAMES)
def test_unsplit_attention_warns_with_line_and_fix(ranks, name: str) -> None:
    for rank, r in enumerate(ranks.run(2, _run, name, False, timeout=240)):
        assert r.get("err", 1.0) <= TOL, (rank, r)
        found = [w for w in r["warnings"] if "attention that ring_cp cannot split" in w]
        assert found, (rank, r["warnings"])
        assert "test_unsplit_attention.py:" in found[0] and "Fix:" in found[0], found
        assert "every rank runs it on the whole sequence" in found[0], found


@pytest.mark.parametrize("name", NAMES)
def test_unsplit_attention_is_refused_under_strict(ranks, name: str) -> None:
    for r in ranks.run(2, _run, name, True, timeout=240):
        assert "strict=True" in r.get("error", ""), r
        # expand_mha refuses first for nn.MultiheadAttention (naming need_weights), unsplit for the rest
        assert "attention that ring_cp cannot split" in r["error"] or "is left whole" in r["error"], r


@pytest.mark.parametrize("name", NAMES)
def test_explain_reports_the_same_finding(name: str) -> None:
    from cp_compile.tools.explain_format import format_explain
    from cp_compile.tools.explain import explain_model

    model, inputs = _model(name)
    text = format_explain(explain_model(model, inputs, world_size=2))
    assert "attention: none found" in text, text
    assert "WARNING: attention that ring_cp cannot split, at" in text and "test_unsplit_attention.py:" in text, text


def test_a_plain_softmax_is_not_attention() -> None:
    """Softmax over a (B, C) logit vector, or over a non-square product: no warning."""
    from cp_compile.tools.explain import explain_model
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.analyze.unsplit import find_unsplit_attention

    class Classifier(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x @ w, dim=-1).sum()  # (B, S, D) @ (D, C): not square

    report = explain_model(Classifier(), (torch.randn(2, 16, 8), torch.randn(8, 5)), world_size=2)
    assert find_unsplit_attention(report.before, RewriteContext(group=report.ctx.group)) == []
