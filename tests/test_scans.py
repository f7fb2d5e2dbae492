"""Scans along the sequence (cp_compile/passes/propagate/rules/scans.py; docs/design.md §6) are exact on the
ranks' shards, without a gather: cumsum (also with ``dtype=`` and of bool values), cumprod (with zeros),
logcumsumexp, cummax / cummin (values and global indices, ties within and across ranks, NaN, integers),
along the sequence of a (B, S, D), a (B, H, S, Dh) and a (B, S) value, written as functions and methods,
with positional, keyword and negative dims. Outputs, the loss (a random weighted sum of every float
scan) and the gradients of the input and of every parameter are compared with the eager model on the
whole sequence: fp64 within 1e-10, fp32 within 1e-5, integers and indices equal; at N = 2 and 4,
zig-zag and contiguous, a dividing and an odd length (padding, whole padding runs at N = 4).
``load_balance="striped"`` has no contiguous runs: there each scan is gathered (warned), still exact.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import explain_record, rel
from cp_compile.tools.explain import explain_model

D, H = 8, 2
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
PER_VIEW = 9  # scans along the sequence per view of _scan_all (gather_stacks, or fallbacks under striped)
IN_LOSS = 6  # of which in the loss (the rest is dead code, erased after the rewrite, when only the loss is returned)
VIEWS = 3


def _scan_all(t: torch.Tensor, marks: torch.Tensor, dim: int, tie: torch.Tensor) -> tuple:
    """Every scan of ``t`` along ``dim`` (its sequence dim): (float values in the loss, other outputs)."""
    zeros, ties = marks == 1, marks == 2
    tied = torch.where(ties, tie, t)  # equal values at many positions, on every rank
    mx, mn = torch.cummax(tied, dim), (-tied).cummin(dim=dim)
    with_nan = torch.where(marks == 3, float("nan"), t).cummax(dim)
    floats = [t.cumsum(dim), torch.cumsum(t, dim=dim, dtype=torch.float64),
              torch.cumprod(torch.where(zeros, 0.0, 1 + 0.2 * torch.tanh(t)), dim), t.logcumsumexp(dim),
              mx.values, mn[0]]
    others = [torch.cumsum(t > 0, dim), mx.indices, mn[1], *torch.cummax((t * 3).long(), dim), *with_nan]
    return floats, others


class Scans(nn.Module):
    """Causal attention on x (it carries the sequence), plus every scan of a linear of x, viewed three ways."""

    def __init__(self, outputs: bool = True) -> None:
        super().__init__()
        self.qkv, self.inp = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.tie = nn.Parameter(torch.tensor(0.8))
        self.outputs = outputs

    def forward(self, x: torch.Tensor, w: torch.Tensor, marks: torch.Tensor):
        B, S = x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).view(B, S, 3, H, D // H).permute(2, 0, 3, 1, 4)
        loss = F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()
        h = self.inp(x)
        loss = loss + (h.cumsum(2) * w).sum() + (h.cummax(-1).values * w).sum()  # along the features: per token
        outs: List[torch.Tensor] = []
        views = ((lambda a: a, 1), (lambda a: a.view(B, S, H, D // H).transpose(1, 2), -2), (lambda a: a[..., 0], -1))
        for view, dim in views:
            floats, others = _scan_all(view(h), view(marks), dim, self.tie)
            for f, wt in zip(floats, (view(w),) * len(floats)):
                loss = loss + (f * wt).sum()
            outs += floats + others
        return (loss, *outs) if self.outputs else loss


def _inputs(s: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(s)
    x = torch.randn(2, s, D, generator=g, dtype=dtype)
    w = torch.randn(2, s, D, generator=g, dtype=dtype)
    marks = torch.multinomial(torch.tensor([0.78, 0.07, 0.12, 0.03]), 2 * s * D, True, generator=g).view(2, s, D)
    return x, w, marks


def _models(dtype: torch.dtype) -> tuple:
    torch.manual_seed(0)
    ref = Scans().to(dtype)
    cp = Scans().to(dtype)
    cp.load_state_dict(ref.state_dict())
    return ref, cp


def _errors(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error of floats (NaN where the reference has NaN), else 0 / inf for equal / unequal."""
    if want.is_floating_point():
        nan = want.isnan()
        if not torch.equal(nan, got.isnan()):
            return float("inf")
        return rel(torch.where(nan, 0, got), torch.where(nan, 0, want))
    return 0.0 if torch.equal(got, want) else float("inf")


def _one_case(s: int, lb: str, dtype: torch.dtype, inner: str, dynamic: bool) -> dict:
    """On a rank: the eager model and ring_cp on the same inputs; every error. Under ``inner="aot_eager"``
    also whether the runtime's record is explain's."""
    import torch.distributed as dist

    import cp_compile

    torch._dynamo.reset()
    ref_model, cp_model = _models(dtype)
    x, w, marks = _inputs(s, dtype)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    explained = explain_record(ref_model, (xr, w, marks), world_size=dist.get_world_size(), load_balance=lb) \
        if inner == "aot_eager" else None
    ref = ref_model(xr, w, marks)
    ref[0].backward()
    backend = cp_compile.RingCP(inner=inner, load_balance=lb)
    out = torch.compile(cp_model, backend=backend, fullgraph=True, dynamic=dynamic or None)(xc, w, marks)
    out[0].backward()
    grads = {n: rel(p.grad, dict(ref_model.named_parameters())[n].grad) for n, p in cp_model.named_parameters()}
    return {"loss": rel(out[0].detach(), ref[0].detach()), "x": rel(xc.grad, xr.grad), "params": max(grads.values()),
            "outputs": [_errors(o.detach(), r.detach()) for o, r in zip(out[1:], ref[1:])],
            "fallbacks": len(backend.fallbacks), "record": explained is None or backend.records == [explained]}


# (S, load_balance, dtype, inner compiler, dynamic): 24 divides by 2N, 21 is padded (at N = 4 the last chunk
# is all padding). inner="eager" runs the rewritten graph as it is (seconds); the "aot" group goes through
# AOTAutograd as a user's torch.compile does (a minute on 2 busy cores). dynamic: S symbolic, the run
# length a graph value. Groups of cases: one ranks.run each, within the per-test timeout on busy cores.
CASES = {
    "aot": [(21, "zigzag", torch.float32, "aot_eager", False)],
    "zigzag": [(24, "zigzag", torch.float64, "eager", False), (21, "zigzag", torch.float64, "eager", False),
               (21, "zigzag", torch.float64, "eager", True)],
    "contiguous_striped": [(24, "contiguous", torch.float64, "eager", False),
                           (21, "contiguous", torch.float64, "eager", False),
                           (21, "striped", torch.float64, "eager", False)],
}


def _cases(group: str) -> list:
    return [_one_case(*case) for case in CASES[group]]


@pytest.mark.slow
@pytest.mark.parametrize("world,group", [(w, g) for w in (2, 4) for g in CASES])
def test_scans_along_the_sequence_are_exact(ranks, world: int, group: str) -> None:
    for rank, results in enumerate(ranks.run(world, _cases, group, timeout=300)):
        for case, r in zip(CASES[group], results):
            where = (world, rank, *case)
            tol = TOL[case[2]]
            assert r["loss"] <= tol and r["x"] <= tol and r["params"] <= tol, (where, r)
            assert max(r["outputs"]) <= tol, (where, r["outputs"])
            assert r["record"], where  # explain says what the runtime did
            assert r["fallbacks"] == (PER_VIEW * VIEWS if case[1] == "striped" else 0), (where, r["fallbacks"])


def _explained(**options):
    x, w, marks = _inputs(21, torch.float32)
    return explain_model(Scans(outputs=False), (x.requires_grad_(), w, marks), world_size=4, **options)


def _calls(report, name: str) -> int:
    return sum(getattr(n.target, "__name__", str(n.target)) == name for n in report.after.graph.nodes)


@pytest.mark.parametrize("lb", ["zigzag", "contiguous"])
def test_no_gather_one_gather_stack_per_scan(lb: str) -> None:
    report = _explained(load_balance=lb)
    assert report.ctx.fallbacks == [], report.ctx.fallbacks
    assert _calls(report, "gather_seq") == 0
    assert _calls(report, "gather_stack") == IN_LOSS * VIEWS


def test_striped_is_gathered_and_says_why() -> None:
    report = _explained(load_balance="striped")
    assert len(report.ctx.fallbacks) == PER_VIEW * VIEWS
    assert all("along the sequence dim: load_balance='striped' on 4 ranks holds no contiguous runs" in f
               and "test_scans.py:" in f for f in report.ctx.fallbacks), report.ctx.fallbacks[0]
    assert _calls(report, "gather_stack") == 0


class _Flattened(nn.Module):
    """A running sum over tokens flattened with the batch, (B·S, D): no runs of one sequence to scan."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S = x.shape[0], x.shape[1]
        q, k, v = self.qkv(x).view(B, S, 3, H, D // H).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum() + x.reshape(B * S, D).cumsum(0).sum()


def test_scan_over_tokens_merged_with_the_batch_is_gathered_and_says_why() -> None:
    report = explain_model(_Flattened(), (torch.randn(2, 16, D),), world_size=2)
    assert len(report.ctx.fallbacks) == 1 and "merged with other dims" in report.ctx.fallbacks[0], report.ctx.fallbacks
