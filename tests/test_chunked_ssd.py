"""The sequence viewed in chunks, and the chunked state-space scan (Mamba2's SSD) under ring_cp.

    x.view(B, S // C, C, D)                      -> Sharded(1, chunk=C): this rank's chunks (runs of whole chunks)
    einsum(exp(segsum(a)), X) over the chunk dim -> DecayScan: each rank scans its chunks from the incoming state

Styles, each the SSD written the way a model library writes it: the paper's reference (segsum by a
masked cumsum, ``einsum("bhzc,bchpn->bzhpn")`` with a zero decay and the initial state in front),
Hugging Face's Mamba2 torch path (the decay matrix transposed, ``einsum("bzch,bzhpn->bchpn")``),
a segsum written as a difference of cumsums, an inclusive scan (the state after each chunk, no
prefix), chunk-local mixing alone (no inter-chunk state), and a hybrid with attention.
Reference: the same model eager on one process, fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import explain_record, grad_errors, loss_through_ring_cp, rel, twin_models

E, H, P, N = 8, 2, 3, 4  # width, heads, head dim, state size
TOL = 1e-5


def segsum_masked(x: torch.Tensor) -> torch.Tensor:
    """(…, T) -> (…, T, T): Σ_{j<k≤i} x_k below the diagonal, -inf above (a masked cumsum)."""
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device)), -torch.inf)


def segsum_diff(x: torch.Tensor) -> torch.Tensor:
    """The same as a difference of cumsums."""
    cs = torch.cumsum(x, -1)
    t = x.size(-1)
    return (cs[..., :, None] - cs[..., None, :]).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))


class Ssd(nn.Module):
    """One SSD mixer (+ an optional causal attention layer) and a loss; ``style`` picks the spelling."""

    def __init__(self, chunk: int = 4, style: str = "paper", attention: bool = False) -> None:
        super().__init__()
        self.chunk, self.style, self.attention = chunk, style, attention
        self.inp = nn.Linear(E, H * P + H + 2 * N)
        self.A_log = nn.Parameter(torch.rand(H) - 1.0)
        self.out = nn.Linear(H * P, E)
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, _ = u.shape
        x, dt, bm, cm = self.inp(u).split([H * P, H, N, N], -1)
        dt = F.softplus(dt)  # (B, S, H)
        x = x.view(b, s, H, P) * dt[..., None]
        a = -torch.exp(self.A_log) * dt  # (B, S, H) log decays
        bm, cm = bm[:, :, None].expand(b, s, H, N), cm[:, :, None].expand(b, s, H, N)
        y = self._ssd(x, a, bm, cm).reshape(b, s, H * P)
        h = u + self.out(y)
        if self.attention:
            q, k, v = self.qkv(h).view(b, s, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
            h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, E)
        return h.square().mean()

    def _ssd(self, x, a, bm, cm):
        b, s = x.shape[:2]
        c = self.chunk
        x, a, bm, cm = [t.reshape(b, s // c, c, *t.shape[2:]) for t in (x, a, bm, cm)]  # (B, n, C, …)
        a = a.permute(0, 3, 1, 2)  # (B, H, n, C)
        acs = torch.cumsum(a, -1)
        seg = segsum_diff if self.style == "diff" else segsum_masked
        decay = torch.exp(seg(a))  # (B, H, n, C, C) within each chunk
        y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", cm, bm, decay, x)
        if self.style == "local":  # chunk-local mixing only
            return y_diag
        b_decay = bm * torch.exp(acs[:, :, :, -1:] - acs).permute(0, 2, 3, 1)[..., None]
        states = torch.einsum("bclhn,bclhp->bchpn", b_decay, x)  # (B, n, H, P, N) each chunk's own state
        if self.style == "inclusive":  # the state after each chunk, read by the next chunk's first token
            after = torch.einsum("bhzc,bchpn->bzhpn", torch.exp(segsum_masked(acs[:, :, :, -1])), states)
            return y_diag + torch.einsum("bclhn,bchpn->bclhp", cm, after)[:, :, :1].expand_as(y_diag) * 0.5
        init = torch.zeros_like(states[:, :1])
        states = torch.cat([init, states], dim=1)
        if self.style == "hf":
            w = torch.exp(segsum_masked(F.pad(acs[:, :, :, -1], (1, 0)))).transpose(1, 3)  # (B, z, c, H)
            entering = torch.einsum("bzch,bzhpn->bchpn", w, states)[:, :-1]
        else:
            w = torch.exp(seg(F.pad(acs[:, :, :, -1], (1, 0))))  # (B, H, z, c)
            entering = torch.einsum("bhzc,bchpn->bzhpn", w, states)[:, :-1]
        y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", cm, entering, torch.exp(acs))
        return y_diag + y_off


def _graph(model: nn.Module, seq: int):
    graphs = []
    torch._dynamo.reset()
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.compile(model, backend=lambda gm, ex: graphs.append((gm, ex)) or gm, fullgraph=True)(x)
    return graphs[0]


@pytest.mark.parametrize("style", ["paper", "hf", "diff", "inclusive"])
def test_the_decay_matrix_product_becomes_one_scan(style) -> None:
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.normalize.decay_scans import fold_decay_scans
    from cp_compile.recurrence.decay_scan import is_decay_scan

    gm, inputs = _graph(Ssd(style=style).double(), 16)
    want = gm(*inputs)
    assert fold_decay_scans(gm, RewriteContext(group=CPGroup(pg=None, rank=0, size=2))) == 1
    [call] = [n for n in gm.graph.nodes if n.op == "call_function" and is_decay_scan(n.target)]
    assert call.target.tokens_per_entry == 4, call.target.tokens_per_entry  # the chunks' tokens
    assert not [n for n in gm.graph.nodes if n.target is torch.cat], gm.code  # the prefix became h0
    torch.testing.assert_close(gm(*inputs), want, rtol=1e-12, atol=1e-12)


def test_a_lower_triangular_matrix_that_is_not_a_decay_is_left_alone() -> None:
    """``tril(exp(a_i - a_j))`` (a difference of the values, not of their cumsum) is not the scan."""
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.normalize.decay_scans import fold_decay_scans

    class NotDecay(nn.Module):
        def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # a (B, T), x (B, T, D)
            t = a.shape[1]
            w = torch.exp(a[:, :, None] - a[:, None, :]).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), 0)
            return torch.einsum("bij,bjd->bid", w, x)

    graphs = []
    torch._dynamo.reset()
    torch.compile(NotDecay(), backend=lambda gm, ex: graphs.append(gm) or gm, fullgraph=True)(
        -torch.rand(2, 6), torch.randn(2, 6, 3))
    assert fold_decay_scans(graphs[0], RewriteContext(group=CPGroup(pg=None, rank=0, size=2))) == 0


def _compare(style: str, seq: int, load_balance: str, chunk: int, attention: bool) -> dict:
    from cp_compile.graph_ops import gather_seq

    ref_model, cp_model = twin_models(lambda: Ssd(chunk, style, attention).double())
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), attention=attention,
                                             load_balance=load_balance)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "recurrences": [r.recurrences for r in backend.records],
            "gathers": sum(n.target is gather_seq for gm in backend.graphs for n in gm.graph.nodes),
            "sharded": [r.sharded_fraction for r in backend.records]}


@pytest.mark.multirank
@pytest.mark.parametrize("style,world,seq,lb,chunk,attention", [
    ("paper", 2, 32, "zigzag", 4, False),  # runs of 8 tokens: two chunks each
    ("hf", 2, 16, "contiguous", 4, True),  # runs of 8, and the ring
    ("diff", 2, 16, "zigzag", 4, False),  # runs of 4: one chunk each
    ("local", 2, 24, "contiguous", 4, True),  # no state across chunks (the ring beside it: else no mixer, no CP)
    pytest.param("paper", 4, 32, "contiguous", 2, False, marks=pytest.mark.slow),
    pytest.param("hf", 4, 32, "zigzag", 4, True, marks=pytest.mark.slow),
])
def test_a_chunked_scan_is_exact_and_never_gathered(ranks, style, world, seq, lb, chunk, attention) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, style, seq, lb, chunk, attention, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"] and r["gathers"] == 0, (rank, r)
        assert [len(x) for x in r["recurrences"]] == [0 if style == "local" else 1], (rank, r)
        assert all(line.startswith("decay_scan_dim1") for x in r["recurrences"] for line in x), (rank, r)


def test_explain_names_the_scan_its_state_and_bytes() -> None:
    record = explain_record(Ssd().double(), (torch.randn(2, 32, E, dtype=torch.float64),), world_size=4, rank=1)
    assert not record.fallbacks, record.fallbacks
    [line] = record.recurrences
    state = 2 * H * P * N  # (B, H, P, N)
    # each run's map and final state (the state's shape each), fp64, from N·k = 4·2 runs
    assert "elementwise" in line and f"state (2, {H}, {P}, {N})" in line, line
    assert f"{4 * 2 * 2 * state * 8} B received per rank" in line, line


def test_runs_that_would_cut_a_chunk_are_refused_by_name() -> None:
    """Chunks of 4 and zig-zag runs of 3 tokens (S = 12 on 2 ranks): the view into chunks is gathered
    (exact), and the WARNING says why and which lengths work."""
    record = explain_record(Ssd().double(), (torch.randn(2, 12, E, dtype=torch.float64),), world_size=2)
    why = [f for f in record.fallbacks if "into chunks of 4 tokens" in f]
    assert why and "not whole chunks of 4" in why[0] and "runs of 3 tokens" in why[0], record.fallbacks


def test_views_into_chunks_and_back() -> None:
    from cp_compile.passes.propagate.placements import Sharded, view_placement

    assert view_placement((2, 16, 6), (2, 4, 4, 6), Sharded(1), 16) == Sharded(1, chunk=4)
    assert view_placement((2, 4, 4, 6), (2, 16, 6), Sharded(1, chunk=4), 16) == Sharded(1)
    assert view_placement((2, 4, 4, 6), (2, 2, 2, 4, 6), Sharded(1, chunk=4), 16) == Sharded(1, chunk=8)
    assert view_placement((2, 16 * 3), (2, 4, 12), Sharded(1, inner=3), 16) == Sharded(1, chunk=4)
    assert view_placement((2, 4, 4, 6), (2, 4, 24), Sharded(1, chunk=4), 16) == Sharded(1, chunk=4)
    assert view_placement((2, 4, 24), (2, 16, 6), Sharded(1, chunk=4), 16) == Sharded(1)
    assert view_placement((2, 16, 6), (2, 8, 12), Sharded(1), 16) == Sharded(1, inner=1, chunk=2)
    assert view_placement((2, 16, 6), (4, 8, 6), Sharded(1), 16) is None  # the batch merged into the chunks
