"""``associative_scan`` along the sequence under ring_cp: run totals, one all-gather, exact, never gathered.

torch's ``associative_scan`` (Mamba / Jamba / Zamba with ``use_associative_scan``) is traced by Dynamo
either as its tree algorithm unrolled (``combine_mode="generic"``, every CPU call) or as the
higher-order op (``"pointwise"``); cp_compile.passes.normalize.assoc_scan makes either one node and
cp_compile.passes.propagate.rules.assoc_scan runs it on each rank's runs of tokens::

    x (B, S, E) Sharded(1) ─ conv (halo), proj ─> a, b (B, D, S/N, N) ─ scan of each run ─ totals ─ one
        gather_stack ─ combine with the totals before each run in global order ─> h Sharded ─ y

Styles: a Mamba-style selective scan (a pair (decay, drive), dim 2, generic), the same through the
higher-order op on CPU, a running (max, count) pair of two dtypes with a combine that reads a
parameter (an extra input), and a hybrid with attention. Reference: the same model eager on one
process, fp64.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan

from checks import grad_errors, loss_through_ring_cp, rel, twin_models

E, D, N = 8, 6, 4
TOL = 1e-5


def linear_combine(left, right):
    """(a, b) pairs of h_t = a_t h_{t-1} + b_t: the earlier map, then the later."""
    a_l, b_l = left
    a_r, b_r = right
    return a_l * a_r, a_r * b_l + b_r


def _flat_combine(a_l, b_l, a_r, b_r):
    return [a_l * a_r, a_r * b_l + b_r]


class SelectiveScan(nn.Module):
    """Mamba's torch path in miniature: conv1d (causal, depthwise) -> dt, B, C -> discretised (a, b)
    (B, D, S, N) -> scan along dim 2 -> y = h C; ``form``: "generic" (torch's tree scan), "hop" (the
    higher-order op, as the GPU path traces it; eager runs the generic form, as Hugging Face's Mamba runs
    the scan only when compiling: torch 2.13's eager backward of the op gives the decay no gradient);
    ``attention``: a causal attention layer after it."""

    def __init__(self, form: str = "generic", attention: bool = False) -> None:
        super().__init__()
        self.form, self.attention = form, attention
        self.inp = nn.Linear(E, D + 1 + 2 * N)
        self.conv = nn.Conv1d(D, D, 3, groups=D, padding=2)
        self.A = nn.Parameter(-torch.rand(D, N) - 0.5)
        self.out = nn.Linear(D, E)
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        u, dt, Bm, C = self.inp(x).split([D, 1, N, N], -1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :s])  # (B, D, S)
        dt = F.softplus(dt).transpose(1, 2)  # (B, 1, S)
        da = torch.exp(self.A[None, :, None, :] * dt[..., None])  # (B, D, S, N)
        db = dt[..., None] * Bm[:, None] * u[..., None]  # (B, D, S, N)
        if self.form == "generic" or not torch.compiler.is_compiling():  # eager: torch's HOP backward
            _, h = associative_scan(linear_combine, (da, db), dim=2, combine_mode="generic")  # misses d/da
        else:  # the op the pointwise form calls, on dim 0
            moved = [t.movedim(2, 0) for t in (da, db)]
            h = torch.ops.higher_order.associative_scan(_flat_combine, moved, ())[1].movedim(0, 2)
        y = (h * C[:, None]).sum(-1).transpose(1, 2)  # (B, S, D)
        y = self.out(y) + x
        if self.attention:
            q, k, v = self.qkv(y).view(b, s, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
            y = y + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, E)
        return y.square().mean()


def running_max_count(floor: torch.Tensor, left, right):
    """An associative combine of two dtypes reading a parameter: (max with a floor, count of tokens)."""
    m_l, n_l = left
    m_r, n_r = right
    return torch.maximum(torch.maximum(m_l, m_r), floor), n_l + n_r


class RunningMax(nn.Module):
    """A running maximum (floored by a parameter) and a running token count, along dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(E, E)
        self.floor = nn.Parameter(torch.tensor(-0.25))
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.inp(x)  # (B, S, E)
        count = torch.ones(z.shape[:2], dtype=torch.int64, device=z.device)  # (B, S)
        m, n = associative_scan(functools.partial(running_max_count, self.floor), (z, count), dim=1,
                                combine_mode="generic")
        return (self.out(m) * n[..., None].to(z.dtype).rsqrt()).square().mean()


MODELS = {"selective": SelectiveScan, "hop": lambda: SelectiveScan("hop"),
          "hybrid": lambda: SelectiveScan(attention=True), "running_max": RunningMax}


def _compare(kind: str, seq: int, load_balance: str) -> dict:
    ref_model, cp_model = twin_models(lambda: MODELS[kind]().double())
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), attention=kind == "hybrid",
                                             load_balance=load_balance)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "scans": [r.recurrences for r in backend.records],
            "gathers": _gathers(backend), "shards": _scan_lengths(backend)}


def _gathers(backend) -> int:
    from cp_compile.graph_ops import gather_seq

    return sum(n.target is gather_seq for gm in backend.graphs for n in gm.graph.nodes)


def _scan_lengths(backend) -> list:
    """The length along dim 0 of every leaf each sharded scan of the rewritten graphs is given."""
    from cp_compile.recurrence.scan import sharded_scan

    return [[x.meta["example_value"].shape[0] if "example_value" in x.meta else None for x in n.args[1]]
            for gm in backend.graphs for n in gm.graph.nodes if n.target is sharded_scan]


@pytest.mark.multirank
@pytest.mark.parametrize("kind,world,seq,lb", [
    ("selective", 2, 15, "zigzag"),
    ("hop", 2, 16, "contiguous"),
    ("running_max", 2, 17, "zigzag"),
    pytest.param("hybrid", 4, 16, "zigzag", marks=pytest.mark.slow),
    pytest.param("selective", 4, 15, "contiguous", marks=pytest.mark.slow),
])
def test_associative_scan_is_exact(ranks, kind, world, seq, lb) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, kind, seq, lb, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"] and r["gathers"] == 0, (rank, r)
        assert [len(x) for x in r["scans"]] == [1], (rank, r)
        assert "associative_scan at" in r["scans"][0][0] and "run totals" in r["scans"][0][0], (rank, r)
        runs = 2 if lb == "zigzag" else 1
        local = runs * -(-seq // (world * runs))  # this rank's tokens, padded
        assert r["shards"] and all(set(s) == {local} for s in r["shards"]), (rank, r["shards"], local)


# -- the normalisation: every traced scan one node, the same numbers (one process, no process group) --------

def _pair_dim2(a, b):
    return associative_scan(linear_combine, (a, b), dim=2, combine_mode="generic")[1]


def _reverse(a, b):
    return associative_scan(linear_combine, (a, b), dim=1, reverse=True, combine_mode="generic")[1]


def _nested(a, b):
    """A dict of leaves, scanned along the last dim."""
    def combine(left, right):
        return {"a": left["a"] * right["a"], "b": right["a"] * left["b"] + right["b"]}
    return associative_scan(combine, {"a": a, "b": b}, dim=-1, combine_mode="generic")["b"]


def _closure(a, b):
    floor = b.mean()  # a tensor the combine closes over (an extra input of the combine module)
    return associative_scan(functools.partial(running_max_count, floor), (a, b), dim=1, combine_mode="generic")[0]


def _two_layers(a, b):
    for _ in range(2):  # one call site, two calls
        b = associative_scan(linear_combine, (a, b), dim=1, combine_mode="generic")[1].tanh()
    return b


def _hop(a, b):
    return torch.ops.higher_order.associative_scan(_flat_combine, [a.movedim(1, 0), b.movedim(1, 0)], ())[1]


STYLES = {"pair_dim2": (_pair_dim2, 1), "reverse": (_reverse, 1), "nested_dict_last_dim": (_nested, 1),
          "closure": (_closure, 1), "two_calls_one_line": (_two_layers, 2), "higher_order_op": (_hop, 1)}


@pytest.mark.parametrize("style", STYLES)
def test_every_traced_scan_becomes_one_node(style) -> None:
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.normalize.assoc_scan import collapse_associative_scans
    from cp_compile.recurrence.scan import scan_leaves

    fn, calls = STYLES[style]
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 13, 3, 5, generator=g, dtype=torch.float64), torch.randn(2, 13, 3, 5, generator=g,
                                                                                dtype=torch.float64)
    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm, fullgraph=True)(a, b)
    gm = graphs[0]
    want = gm(a, b)
    assert collapse_associative_scans(gm, RewriteContext(group=CPGroup(pg=None, rank=0, size=2))) == calls
    assert sum(n.target is scan_leaves for n in gm.graph.nodes) == calls
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice], gm.code  # no tree scan left
    got = gm(a, b)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# -- explain (no process group): what is split, what is refused ---------------------------------------------

def test_explain_names_the_scan_and_its_bytes() -> None:
    from checks import explain_record

    model = SelectiveScan().double()
    record = explain_record(model, (torch.randn(2, 16, E, dtype=torch.float64),), world_size=4, rank=1)
    assert not record.fallbacks, record.fallbacks
    [line] = record.recurrences
    # the totals of both leaves (da, db), one (B, D, N) element each, fp64, from N·k = 4·2 runs
    assert f"{4 * 2 * 2 * (2 * D * N) * 8} B received per rank" in line and "2 run(s) per rank" in line, line


def test_striped_layout_gathers_the_scan_with_a_warning() -> None:
    from checks import explain_record

    model = SelectiveScan().double()
    record = explain_record(model, (torch.randn(2, 16, E, dtype=torch.float64),), world_size=2,
                            load_balance="striped")
    assert not record.recurrences
    assert any("associative_scan" in f and "load_balance='striped'" in f and "fix:" in f for f in record.fallbacks), \
        record.fallbacks


class FeatureScan(nn.Module):
    """A scan along the features (dim -1) of a sequence-split value: per token, and the model's mixer is an
    attention layer after it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a = torch.sigmoid(x)
        y = associative_scan(linear_combine, (a, x), dim=-1, combine_mode="generic")[1]  # (B, S, E)
        q, k, v = self.qkv(y).view(b, s, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def test_a_scan_along_the_features_is_per_token() -> None:
    from checks import explain_record

    record = explain_record(FeatureScan().double(), (torch.randn(2, 16, E, dtype=torch.float64),), world_size=2)
    assert not record.fallbacks and not record.recurrences, record
    assert record.rings == 1, record
