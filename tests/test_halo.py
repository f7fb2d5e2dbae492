"""Neighbour reads along the sequence on the ranks' shards: convolutions, token shifts and ``roll``
(cp_compile/passes/propagate/rules/halo.py, folded first by cp_compile/passes/normalize/neighbours.py).

Two models hold every spelling, one op after another (each op's own weight and bias get their own
gradient, and an error in any op changes the output): :class:`Convs` (a "same" convolution with
symmetric padding and with the padding="same" string, kernels 1 to 4, dilation 1 and 2, full,
grouped and depthwise, with and without bias, the causal ``F.pad`` + conv and Mamba's
``conv1d(x)[..., :S]``) and :class:`Shifts` (RWKV's ``F.pad(x, (0, 0, 1, -1))`` and
``nn.ZeroPad2d``, a shift back, ``cat([zeros, x[:, :-1]])``, ``roll`` by ±1 and ±3). Each runs at
N = 2 and 4, zig-zag and contiguous, on a length that divides and one that is padded, against the
eager model on the whole sequence: the op chain's output, the loss, the input's and every
parameter's gradient (fp64: 1e-10; one fp32 run: 1e-5). Single-process: the rewritten graph has
no fallback and no ``gather_seq``, one ``gather_stack`` per op that reads neighbours.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import explain_record, grad_errors, rel, twin_models
from cp_compile import graph_ops
from cp_compile.tools.explain import explain_model

B, D = 2, 8


class _Attend(nn.Module):
    """A causal attention over (B, S, D) and the loss read from it and from ``h`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean() + h.square().mean()


class Convs(nn.Module):
    """Every convolution spelling along the sequence, in a chain over (B, C, S)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.attend = nn.Linear(D, D), _Attend()
        self.same3 = nn.Conv1d(D, D, 3, padding=1)  # symmetric, K=3
        self.same_str = nn.Conv1d(D, D, 2, padding="same")  # K=2: (0, 1)
        self.same_dil = nn.Conv1d(D, D, 3, padding="same", dilation=2, groups=D)  # depthwise, (2, 2)
        self.point = nn.Conv1d(D, D, 1, bias=False)  # K=1: per token
        self.causal4 = nn.Conv1d(D, D, 4)  # F.pad (3, 0) first
        self.causal_dil = nn.Conv1d(D, D, 3, dilation=2, groups=D)  # F.pad (4, 0) first, depthwise
        self.mamba = nn.Conv1d(D, D, 4, groups=D, padding=3)  # conv(x)[..., :S]
        self.mamba2 = nn.Conv1d(D, D, 2, groups=2, padding=1, bias=False)  # grouped, K=2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        t = self.inp(x).transpose(1, 2)  # (B, C, S): the sequence is the conv's length dim
        t = t + self.same3(t)
        t = t + self.same_str(t)
        t = t + self.same_dil(t)
        t = t + self.point(t)
        t = t + self.causal4(F.pad(t, (3, 0)))
        t = t + self.causal_dil(F.pad(t, (4, 0)))
        t = t + self.mamba(t)[..., :s]
        t = self.mamba2(t)[:, :, :s]
        return t.transpose(1, 2)


class Shifts(nn.Module):
    """Token shifts and rolls along the sequence of (B, S, D)."""

    def __init__(self, rolls: bool = True) -> None:
        super().__init__()
        self.inp, self.attend, self.rolls = nn.Linear(D, D), _Attend(), rolls
        self.mix = nn.Parameter(torch.rand(6, D))
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))  # RWKV

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, m = self.inp(x), self.mix
        h = h + m[0] * self.time_shift(h)
        h = h + m[1] * F.pad(h, (0, 0, -1, 1))  # the next token
        h = h + m[2] * torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        h = h + m[3] * torch.cat([h[:, 2:], torch.zeros_like(h[:, :2])], dim=1)
        if self.rolls:
            h = h + m[4] * torch.roll(h, 1, dims=1) + m[5] * h.roll(-1, 1)
            h = h * torch.roll(h, shifts=-3, dims=1) + torch.roll(h, 3, 1)
        return h


def neighbour_ops(model: nn.Module) -> int:
    """How many ops of ``model`` read neighbours (one gather_stack each): every conv with a kernel over 1,
    every shift and roll."""
    if isinstance(model, Convs):
        return sum(1 for m in model.modules() if isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1)  # 7
    return 4 + (4 if model.rolls else 0)


class Whole(nn.Module):
    """``inner`` then the attention and loss; returns (loss, the chain's output)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> Any:
        h = self.inner(x)
        return self.inner.attend(h), h


def _run(kind: str, s: int, dtype: torch.dtype, **options: Any) -> dict:
    """On a rank: the model of ``kind`` through ring_cp against eager on the whole sequence."""
    import torch.distributed as dist

    import cp_compile

    torch._dynamo.reset()
    make = {"convs": Convs, "shifts": Shifts}[kind]
    ref_model, cp_model = (m.to(dtype) for m in twin_models(lambda: Whole(make())))
    x = torch.randn(B, s, D, generator=torch.Generator().manual_seed(s), dtype=dtype)
    explained = explain_record(ref_model, (x,), world_size=dist.get_world_size(), **options)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref_loss, ref_h = ref_model(xr)
    ref_loss.backward()
    backend = cp_compile.RingCP(inner="aot_eager", **options)
    loss, h = torch.compile(cp_model, backend=backend, fullgraph=True)(xc)
    loss.backward()
    assert backend.records == [explained], (backend.records, explained)
    errors = grad_errors(cp_model, ref_model, truth=_fp64_grads(ref_model, x) if dtype == torch.float32 else None)
    return {"case": (kind, s, str(dtype), options), "out": rel(h.detach(), ref_h.detach()),
            "loss": rel(loss.detach(), ref_loss.detach()), "x": rel(xc.grad, xr.grad),
            "grads": max(errors.values()), "fallbacks": list(backend.fallbacks),
            "every_grad": len(errors) == len(list(cp_model.parameters()))}


def _fp64_grads(model: nn.Module, x: torch.Tensor) -> dict:
    """The float64 gradients of (a copy of) ``model`` at ``x``: the truth a float32 gradient of cancelling
    terms is judged against (examples/_exact.py)."""
    import copy

    twin = copy.deepcopy(model).double()
    twin.zero_grad()
    twin(x.double())[0].backward()
    return {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}


def _cases(world: int) -> list:
    s = 8 * world  # zig-zag runs of 4 tokens: room for the widest halo (4)
    out = []
    for lb in ("zigzag", "contiguous") if world == 2 else ("zigzag",):  # N = 4: zig-zag's 8 runs (suite time)
        for length in (s, s - 1):  # divides; padded
            for kind in ("convs", "shifts"):
                out.append(_run(kind, length, torch.float64, load_balance=lb))
    if world == 2:
        out.append(_run("convs", s - 1, torch.float32))
        out.append(_run("shifts", s, torch.float32))
        out.append(_run("convs", s, torch.float64, load_balance="striped"))  # no runs: gathered, still exact
    return out


def _check(results: list, world: int) -> None:
    for r in results:
        kind, length, dtype, options = r["case"]
        tol = 1e-10 if dtype == "torch.float64" else 1e-5
        errs = (r["out"], r["loss"], r["x"], r["grads"])
        assert max(errs) <= tol and r["every_grad"], r
        lb = options.get("load_balance", "zigzag")
        padded = length % (2 * world) != 0
        if lb == "striped":
            assert len(r["fallbacks"]) == 7 and all("no contiguous runs" in f for f in r["fallbacks"]), r
        elif kind == "shifts" and padded:  # roll's wrap along a padded sequence: gathered (warned)
            assert len(r["fallbacks"]) == 4 and all("roll along a sequence padded" in f for f in r["fallbacks"]), r
        else:
            assert r["fallbacks"] == [], r


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_neighbour_reads_are_exact_on_the_shards(ranks, world: int) -> None:
    for results in ranks.run(world, _cases, world, timeout=300):
        _check(results, world)


# ---------------------------------------------------------------------------------------- the rewritten graph
def _targets(report: Any, fn: Any) -> int:
    return sum(1 for n in report.after.graph.nodes if n.target is fn)


@pytest.mark.parametrize("kind", ["convs", "shifts"])
@pytest.mark.parametrize("world,load_balance", [(2, "zigzag"), (4, "contiguous")])
def test_no_gather_and_one_gather_stack_per_neighbour_op(kind: str, world: int, load_balance: str) -> None:
    torch.manual_seed(0)
    inner = {"convs": Convs, "shifts": Shifts}[kind]()
    s = 8 * world - (1 if kind == "convs" else 0)  # convs also padded (the shifts' rolls fall back there)
    report = explain_model(_Loss(inner), (torch.randn(B, s, D),), world_size=world, load_balance=load_balance)
    assert report.ctx.fallbacks == [], report.ctx.fallbacks
    assert _targets(report, graph_ops.gather_seq) == 0
    assert _targets(report, graph_ops.gather_stack) == neighbour_ops(inner) == (7 if kind == "convs" else 8)


class _Loss(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.attend(self.inner(x))


class _Refused(nn.Module):
    """One convolution along the sequence that the halo cannot do (the output's length is not S, or the
    halo is wider than a rank's run), before an attention."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.attend = kind, _Attend()
        stride = kind == "stride"
        self.conv = nn.Conv1d(D, D, 9 if kind == "wide" else 3, stride=2 if stride else 1, padding=int(stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.transpose(1, 2)
        if self.kind == "stride":  # (B, C, S/2): not the sequence any more
            return self.attend(F.interpolate(self.conv(t), scale_factor=2).transpose(1, 2))
        if self.kind == "wide":  # causal, K = 9: 8 tokens of halo, a zig-zag run of 4 at S = 16
            return self.attend(self.conv(F.pad(t, (8, 0))).transpose(1, 2))
        return self.attend(self.conv(F.pad(t, (1, 2))).transpose(1, 2)[:, :-1])  # S + 1 long, then sliced


@pytest.mark.parametrize("kind,why", [("stride", "stride"), ("wide", "wider than a rank's run"),
                                      ("long", "padded by (1, 2)")])
def test_what_the_halo_cannot_do_is_gathered_and_named(kind: str, why: str) -> None:
    torch.manual_seed(0)
    report = explain_model(_Refused(kind), (torch.randn(B, 16, D),), world_size=2)
    assert any(why in f for f in report.ctx.fallbacks), report.ctx.fallbacks
    assert _targets(report, graph_ops.gather_stack) == 0
