"""The rule oracle (cp_compile/passes/propagate/oracle.py; docs/design.md §8): ops the rule table
does not list are decided from their ATen decomposition before the rewrite gathers the sequence.
Per-token ops stay sharded; ops that mix tokens still gather (and warn)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import AttentionCount, explain_record, grad_errors, loss_through_ring_cp, rel, ring_mismatches, twin_models
from cp_compile.tools.explain import explain_model
from cp_compile.passes.propagate import oracle
from cp_compile.passes.propagate.rules.table import RULES

S, D, TOL = 16, 8, 1e-5


class _Op(nn.Module):
    """``op(x)`` on x (B, S, D), then attention: x is the sharded sequence input."""

    def __init__(self, op: Callable) -> None:
        super().__init__()
        self.op = op
        self.qkv = nn.Linear(D, 3 * D)
        self.table = nn.Parameter(torch.randn(S, D))  # one row per position: indexed when it meets x
        self.bias = nn.Parameter(torch.randn(2, 2, 4, 4))  # per (batch, head) bias of a baddbmm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        h = self.op(self, x)
        q, k, v = self.qkv(h).view(B, S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(2, S, 2, D // 2).transpose(1, 2).reshape(4, S, D // 2)  # (B*H, S, Dh)


def _baddbmm(m: _Op, x: torch.Tensor) -> torch.Tensor:
    out = torch.baddbmm(_heads(x), _heads(x), m.bias.view(4, 4, 4), alpha=0.5)  # over heads, (Dh, Dh) right
    return out.view(2, 2, S, D // 2).transpose(1, 2).reshape(2, S, D)


PER_TOKEN = {  # name -> (op, what the hand table must not list)
    "erf": (lambda m, x: torch.erf(x), torch.erf),
    "lerp": (lambda m, x: torch.lerp(x, x * 2, 0.3), torch.lerp),
    "lerp_table": (lambda m, x: torch.lerp(x, m.table, 0.3), torch.lerp),
    "addcmul": (lambda m, x: torch.addcmul(x, x, m.table, value=0.5), torch.addcmul),
    "logaddexp": (lambda m, x: torch.logaddexp(x, x * 0.5), torch.logaddexp),
    "clamp_min": (lambda m, x: torch.clamp_min(x, 0.1), torch.clamp_min),
    "method_clamp_min": (lambda m, x: x.clamp_min(0.1), ("method", "clamp_min")),
    "normalize_features": (lambda m, x: F.normalize(x, dim=-1), F.normalize),
    "flip_features": (lambda m, x: x.flip(-1), ("method", "flip")),
    "baddbmm_heads": (_baddbmm, torch.baddbmm),
    "amax_features": (lambda m, x: x - x.amax(-1, keepdim=True), ("method", "amax")),  # (topk has a rule: order.py)
    # in place on a sharded destination, along the features (DeepSeek-V3's group mask: mask.scatter_(1, idx, 1))
    "scatter_in_place_features": (lambda m, x: x.clone().scatter_(-1, x.argmax(-1, keepdim=True), 0.0),
                                  ("method", "scatter_")),
    # SqueezeBERT's (B, C, S) 1x1 convolutions: a linear per position (conv1d has a hand rule, rules/halo.py;
    # the oracle keeps a kernel of 1 along the sequence in any convolution: here a conv2d over (S, 1))
    "conv2d_kernel_1": (lambda m, x: F.conv2d(x.transpose(1, 2)[..., None], m.table[:D, :, None, None])
                        .squeeze(-1).transpose(1, 2), torch.conv2d),
}
# The scans (cumsum, cumprod, logcumsumexp, cummax, cummin) have a hand rule (rules/scans.py:
# tests/test_scans.py); that the oracle alone still stops on one along the sequence written with a
# negative dim (DTensor compares the dim as written) is tests/test_rules.py's sweep of their samples.
MIXING = {
    "normalize_seq": lambda m, x: F.normalize(x, dim=1),
    "softmax_seq": lambda m, x: x.softmax(1),
    "flip_seq": lambda m, x: x.flip(1),
    "amax_seq": lambda m, x: x - x.amax(1, keepdim=True),  # (topk over the sequence has a rule: order.py)
    "conv2d_kernel_3_seq": lambda m, x: F.conv2d(x.transpose(1, 2)[..., None], m.table[:D, :, None, None]
                                                 .expand(D, D, 3, 1), padding=(1, 0)).squeeze(-1).transpose(1, 2),
}


def _report(op: Callable):
    torch.manual_seed(0)
    return explain_model(_Op(op), (torch.randn(2, S, D),), world_size=2)


@pytest.mark.parametrize("name", sorted(PER_TOKEN))
def test_per_token_op_without_a_rule_stays_sharded(name: str) -> None:
    op, key = PER_TOKEN[name]
    assert key not in RULES, f"{key} has a hand rule: this test would not reach the oracle"
    before = oracle.STATS["per_token"]
    report = _report(op)
    assert report.ctx.fallbacks == [], report.ctx.fallbacks
    assert oracle.STATS["per_token"] > before  # the oracle decided it (not a hand rule)


@pytest.mark.parametrize("name", sorted(MIXING))
def test_op_mixing_tokens_still_gathers(name: str) -> None:
    report = _report(MIXING[name])
    assert len(report.ctx.fallbacks) == 1, report.ctx.fallbacks


def test_whole_table_is_indexed_by_position() -> None:
    """lerp(x, table (S, D)): the table is indexed by this rank's positions, not gathered."""
    report = _report(PER_TOKEN["lerp_table"][0])
    lerp = next(n for n in report.after.graph.nodes if n.target is torch.lerp)
    assert lerp.args[1].target == "index_select", lerp.args
    assert tuple(lerp.meta["val"].shape) == (2, S // 2, D)


def test_verdicts_are_cached_per_signature() -> None:
    twice = lambda m, x: torch.erf(torch.erf(x) * 1.5)  # noqa: E731 (same signature twice)
    oracle._CACHE.clear()
    before = dict(oracle.STATS)
    assert _report(twice).ctx.fallbacks == []
    assert oracle.STATS["traced"] - before["traced"] == 1 and oracle.STATS["cached"] - before["cached"] == 1


def test_oracle_errors_mean_fallback(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    oracle._CACHE.clear()
    monkeypatch.setattr(oracle, "trace", broken)
    report = _report(PER_TOKEN["erf"][0])
    assert len(report.ctx.fallbacks) == 1 and "erf is not known to be per-token" in report.ctx.fallbacks[0]
    oracle._CACHE.clear()


class _Mix(nn.Module):
    """A small model whose per-token ops are all oracle-decided: erf, lerp with a position
    table, addcmul, logaddexp, normalize over features, clamp_min; then causal attention."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.qkv, self.out = nn.Linear(D, D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.table = nn.Parameter(torch.randn(S, D) * 0.1)
        self.scale = nn.Parameter(torch.rand(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        h = torch.erf(self.inp(x))
        h = torch.lerp(h, self.table, 0.25)
        h = torch.addcmul(h, h, self.scale, value=0.5)
        h = F.normalize(torch.logaddexp(h, h * 0.5), dim=-1).clamp_min(-0.9)
        q, k, v = self.qkv(h).view(B, S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
        return self.out(a).pow(2).mean()


def _mix_exact() -> dict:
    ref_model, cp_model = twin_models(_Mix)
    x = torch.randn(2, S, D, generator=torch.Generator().manual_seed(1))
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,))
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grad_errors(cp_model, ref_model).values()),
            "fallbacks": [f for r in backend.records for f in r.fallbacks]}


def test_oracle_decided_model_is_exact_on_two_ranks(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _mix_exact, timeout=240)):
        assert r["fallbacks"] == [], (rank, r["fallbacks"])
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)


class _Dyn(nn.Module):
    """Oracle-decided ops under a symbolic S (dynamic=True), at a length that needs padding."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        h = F.normalize(torch.logaddexp(torch.erf(x), x * 0.5), dim=-1).clamp_min(-0.9)
        q, k, v = self.qkv(h).view(B, L, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).mean()


def _dyn_exact(seq_len: int) -> dict:
    import cp_compile

    torch._dynamo.reset()
    ref_model, cp_model = twin_models(_Dyn)
    x = torch.randn(2, seq_len, D, generator=torch.Generator().manual_seed(1))
    explained = explain_record(ref_model, (x,), world_size=torch.distributed.get_world_size(), dynamic=True)
    with AttentionCount() as count:
        ref = ref_model(x)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend, fullgraph=True, dynamic=True)(x)
    out.backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grad_errors(cp_model, ref_model).values()),
            "fallbacks": [f for r in backend.records for f in r.fallbacks],
            "rings": ring_mismatches(backend, count.calls)}


def test_oracle_under_dynamic_shapes_with_padding(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _dyn_exact, 15, timeout=240)):
        assert r["fallbacks"] == [] and r["rings"] == [], (rank, r["fallbacks"], r["rings"])
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
