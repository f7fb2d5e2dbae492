"""Recurrences written as Python loops (Dynamo unrolls them) under ring_cp: folded into one kernel,
run on each rank's runs from the state entering each run, exact, never gathered.

    for t in range(S):  h = step(h, x[:, t]);  out[:, t] = y   |   ys.append(y) ... torch.stack(ys, 1)

cp_compile.passes.normalize.fold_loops turns the S unrolled copies back into one LoopKernel call; the
rule for recurrent kernels then runs it per run: in parallel from O(state) summaries when the step
is elementwise affine in its state, else the state handed rank to rank (warned). Styles, each a
loop written the way a model library writes it: RG-LRU's ``_rnn_scan`` (writes into a preallocated
buffer, fp32 casts, ``.to(device)`` of the state), Mamba's sequential scan (a list and
``torch.stack``, the output a matmul with the new state), an output read from the state *before*
the update (lightning attention's order), an Elman RNN (``tanh(h W + x_t)``: not affine, serial),
two states side by side (a numerator and a denominator: packed, parallel), RWKV's wkv loop (three
states and a running max: serial), lightning attention's block loop (a step per block of C tokens,
``x[:, i*C:(i+1)*C]``: each rank's runs hold whole blocks), and a hybrid with attention.
Reference: the same model eager on one process, fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import explain_record, grad_errors, loss_through_ring_cp, rel, twin_models

E, D, N = 8, 6, 4
TOL = 1e-5


class RgLru(nn.Module):
    """RG-LRU's scan as recurrent_gemma writes it: a gated decay, a buffer written per position."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.inp, self.out = nn.Linear(E, D), nn.Linear(E, D), nn.Linear(D, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, u = torch.sigmoid(self.gate(x)), self.inp(x)  # (B, S, D)
        h = torch.zeros(u[:, 0].shape, dtype=torch.float32, device=u.device)
        out = torch.zeros_like(u)
        for t in range(u.shape[1]):
            h = a[:, t].type(torch.float32) * h.to(a.device)
            h = h + u[:, t].type(torch.float32)
            out[:, t] = h.type(u.dtype)
        return (self.out(out) + x).square().mean()


class MambaLoop(nn.Module):
    """Mamba's sequential selective scan: (B, D, S, N) decays and drives, y_t = h_t C_t, a list stacked."""

    def __init__(self, attention: bool = False) -> None:
        super().__init__()
        self.attention = attention
        self.inp = nn.Linear(E, D + 1 + 2 * N)
        self.A = nn.Parameter(-torch.rand(D, N) - 0.5)
        self.out = nn.Linear(D, E)
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        u, dt, Bm, C = self.inp(x).split([D, 1, N, N], -1)
        dt = F.softplus(dt).transpose(1, 2)  # (B, 1, S)
        da = torch.exp(self.A[None, :, None, :] * dt[..., None])  # (B, D, S, N)
        db = dt[..., None] * Bm[:, None] * u.transpose(1, 2)[..., None]  # (B, D, S, N)
        h = torch.zeros(b, D, N, dtype=x.dtype, device=x.device)
        ys = []
        for i in range(s):
            h = da[:, :, i, :] * h + db[:, :, i, :]
            ys.append(torch.matmul(h, C[:, i, :].unsqueeze(-1))[:, :, 0])  # (B, D)
        y = self.out(torch.stack(ys, dim=-1).transpose(1, 2)) + x  # (B, S, E)
        if self.attention:
            q, k, v = self.qkv(y).view(b, s, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
            y = y + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, E)
        return y.square().mean()


class ReadBeforeUpdate(nn.Module):
    """A decayed running sum whose output reads the state entering the step (then updates it)."""

    def __init__(self) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.rand(D) * 0.5 + 0.4)
        self.q, self.v, self.out = nn.Linear(E, D), nn.Linear(E, D), nn.Linear(D, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, v = self.q(x), self.v(x)
        h = torch.zeros(x.shape[0], D, dtype=x.dtype)
        outs = []
        for t in range(x.shape[1]):
            outs.append(q[:, t] * h + v[:, t])  # reads h_{t-1}
            h = self.decay * h - 0.5 * v[:, t]
        return self.out(torch.stack(outs, 1)).square().mean()


class Elman(nn.Module):
    """h_t = tanh(h_{t-1} W + x_t): not affine in the state, so the state is handed rank to rank."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(E, D), nn.Linear(D, E)
        self.W = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.inp(x)
        h = torch.zeros(x.shape[0], D, dtype=x.dtype)
        out = torch.empty_like(u)
        for t in range(x.shape[1]):
            h = torch.tanh(h @ self.W + u[:, t])
            out[:, t] = h
        return self.out(out).square().mean()


class TwoStates(nn.Module):
    """Normalised decayed linear attention: a numerator and a denominator carried side by side, each
    elementwise affine in itself (two states packed into one, run in parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.k, self.v, self.q = nn.Linear(E, D), nn.Linear(E, D), nn.Linear(E, D), nn.Linear(E, D)
        self.out = nn.Linear(D, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, k, v, q = torch.sigmoid(self.gate(x)), torch.exp(self.k(x).clamp(max=3)), self.v(x), self.q(x)
        num = torch.zeros(x.shape[0], D, dtype=x.dtype)
        den = torch.ones(x.shape[0], D, dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            num = a[:, t] * num + k[:, t] * v[:, t]
            den = a[:, t] * den + k[:, t]
            ys.append(q[:, t] * num / den)
        return self.out(torch.stack(ys, 1)).square().mean()


class Wkv(nn.Module):
    """RWKV's CPU wkv loop: a numerator, a denominator and a running max for stability, the initial
    states shaped after ``zeros_like(k[:, 0])``; the max is not affine, so the three pass serially."""

    def __init__(self) -> None:
        super().__init__()
        # no key bias: the wkv average is invariant to a shift of every key, so its gradient would be 0
        self.k, self.v, self.out = nn.Linear(E, D, bias=False), nn.Linear(E, D), nn.Linear(D, E)
        self.time_decay, self.time_first = nn.Parameter(torch.randn(D) * 0.3), nn.Parameter(torch.randn(D) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.k(x), self.v(x)
        out = torch.zeros_like(k)
        num, den = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
        mx = torch.zeros_like(k[:, 0]) - 1e38
        w = -torch.exp(self.time_decay)
        for t in range(k.shape[1]):
            kt, vt = k[:, t], v[:, t]
            m_out = torch.maximum(mx, kt + self.time_first)
            e1, e2 = torch.exp(mx - m_out), torch.exp(kt + self.time_first - m_out)
            out[:, t] = (e1 * num + e2 * vt) / (e1 * den + e2)
            m_next = torch.maximum(mx + w, kt)
            e1, e2 = torch.exp(mx + w - m_next), torch.exp(kt - m_next)
            num, den, mx = e1 * num + e2 * vt, e1 * den + e2, m_next
        return self.out(out).square().mean()


class BlockLoop(nn.Module):
    """Lightning attention's block loop (MiniMax): per block of C tokens, decayed attention inside the
    block plus the block's queries against the state, then the state decayed by the block and updated
    by its keys and values: ``kv = kv * exp(-s C) + (k * kdecay)ᵀ v``. The outputs are a list
    concatenated, or (``buffer``) written into a preallocated buffer block by block."""

    def __init__(self, buffer: bool = False, block: int = 4) -> None:
        super().__init__()
        self.buffer, self.block = buffer, block
        self.qkv, self.out = nn.Linear(E, 3 * D), nn.Linear(D, E)
        self.slope = 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.block
        q, k, v = self.qkv(x).chunk(3, -1)  # (B, S, D) each
        idx = torch.arange(c, dtype=x.dtype)
        q_decay = torch.exp(-self.slope * (idx + 1))[:, None]  # (C, 1)
        k_decay = torch.exp(-self.slope * (c - 1 - idx))[:, None]  # (C, 1)
        diff = idx[:, None] - idx[None, :]
        diag = torch.where(diff >= 0, torch.exp(-self.slope * diff), torch.zeros_like(diff))  # (C, C) causal
        block_decay = torch.exp(torch.tensor(-self.slope * c, dtype=x.dtype))
        kv = torch.zeros(b, D, D, dtype=x.dtype)
        outs, buf = [], torch.empty_like(q)
        for i in range((s + c - 1) // c):
            lo, hi = i * c, min((i + 1) * c, s)
            qi, ki, vi = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]
            y = ((qi @ ki.transpose(1, 2)) * diag) @ vi + (qi * q_decay) @ kv
            if self.buffer:
                buf[:, lo:hi] = y
            else:
                outs.append(y)
            kv = kv * block_decay + (ki * k_decay).transpose(1, 2) @ vi
        y = buf if self.buffer else torch.cat(outs, 1)
        return self.out(y).square().mean()


class PerHead(nn.Module):
    """Attention one head at a time, summed into an accumulator: a loop with a carried value that is
    not a recurrence over the tokens (it runs over heads, its steps hold attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E // 2, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, E // 4).permute(2, 0, 3, 1, 4)  # (B, 4 heads, S, 2) each
        acc = torch.zeros(b, 1, s, E // 4, dtype=x.dtype)
        for h in range(4):  # q[:, h:h+1]: (B, 1, S, 2), a block of one head
            acc = acc + F.scaled_dot_product_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], is_causal=True)
        return self.out(torch.cat([acc[:, 0], x[..., :E // 4]], -1)).square().mean()


MODELS = {"rglru": RgLru, "mamba": MambaLoop, "read_before_update": ReadBeforeUpdate, "elman": Elman,
          "hybrid": lambda: MambaLoop(attention=True), "two_states": TwoStates, "wkv": Wkv, "blocks": BlockLoop,
          "block_buffer": lambda: BlockLoop(buffer=True)}
TRANSITIONS = {"rglru": "elementwise", "mamba": "elementwise", "read_before_update": "elementwise",
               "elman": "serial", "hybrid": "elementwise", "two_states": "elementwise", "wkv": "serial",
               "blocks": "elementwise", "block_buffer": "elementwise"}


def _compare(kind: str, seq: int, load_balance: str) -> dict:
    ref_model, cp_model = twin_models(lambda: MODELS[kind]().double())
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), attention=kind == "hybrid",
                                             load_balance=load_balance)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "recurrences": [r.recurrences for r in backend.records],
            "gathers": _gathers(backend)}


def _gathers(backend) -> int:
    from cp_compile.graph_ops import gather_seq

    return sum(n.target is gather_seq for gm in backend.graphs for n in gm.graph.nodes)


@pytest.mark.multirank
@pytest.mark.parametrize("kind,world,seq,lb", [
    ("rglru", 2, 15, "zigzag"),
    ("mamba", 2, 16, "contiguous"),
    pytest.param("read_before_update", 2, 17, "zigzag", marks=pytest.mark.slow),  # 7.4 s in the record
    ("elman", 2, 16, "zigzag"),
    ("two_states", 2, 15, "zigzag"),
    ("wkv", 2, 16, "contiguous"),
    ("blocks", 2, 16, "zigzag"),  # runs of 4 tokens: one block each
    ("block_buffer", 2, 24, "contiguous"),  # runs of 12: three blocks each
    pytest.param("blocks", 4, 32, "zigzag", marks=pytest.mark.slow),
    pytest.param("two_states", 4, 16, "contiguous", marks=pytest.mark.slow),
    pytest.param("hybrid", 4, 16, "zigzag", marks=pytest.mark.slow),
    pytest.param("rglru", 4, 13, "contiguous", marks=pytest.mark.slow),
    pytest.param("elman", 4, 15, "contiguous", marks=pytest.mark.slow),
])
def test_a_loop_recurrence_is_exact_and_never_gathered(ranks, kind, world, seq, lb) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, kind, seq, lb, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"] and r["gathers"] == 0, (rank, r)
        assert [len(x) for x in r["recurrences"]] == [1], (rank, r)
        line = r["recurrences"][0][0]
        assert line.startswith("loop_at_") and ("serial" in line) == (TRANSITIONS[kind] == "serial"), (rank, line)


# -- the fold itself (one process): every style one kernel call, the same numbers ------------------

@pytest.mark.parametrize("kind", ["rglru", "mamba", "read_before_update", "elman", "two_states", "wkv", "blocks",
                                  "block_buffer"])
def test_every_unrolled_loop_becomes_one_kernel_call(kind) -> None:
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.normalize.fold_loops import fold_recurrence_loops
    from cp_compile.recurrence.loops import is_loop_kernel

    model = MODELS[kind]().double()
    x = torch.randn(2, 12, E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    graphs = []
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, ex: graphs.append((gm, ex)) or gm, fullgraph=True)(x)
    gm, inputs = graphs[0]
    want = gm(*inputs)
    before = len(gm.graph.nodes)
    assert fold_recurrence_loops(gm, RewriteContext(group=CPGroup(pg=None, rank=0, size=2))) == 1
    [call] = [n for n in gm.graph.nodes if n.op == "call_function" and is_loop_kernel(n.target)]
    assert call.target.transition == TRANSITIONS[kind]
    steps = 12 // 4 if kind.startswith("block") else 12  # blocks of 4 tokens, or positions
    assert len(gm.graph.nodes) < before * (1 if steps > 3 else 2) // 3, gm.code  # the copies are gone
    torch.testing.assert_close(gm(*inputs), want, rtol=1e-12, atol=1e-12)


def test_explain_names_the_loop_its_state_and_bytes() -> None:
    record = explain_record(MambaLoop().double(), (torch.randn(2, 16, E, dtype=torch.float64),), world_size=4,
                            rank=1)
    assert not record.fallbacks, record.fallbacks
    [line] = record.recurrences
    # the map and the final state, (B, D, N) each, fp64, from N·k = 4·2 runs
    assert f"{4 * 2 * 2 * (2 * D * N) * 8} B received per rank" in line and "elementwise" in line, line


def test_a_serial_loop_is_warned(caplog) -> None:
    with caplog.at_level("WARNING", logger="cp_compile"):
        record = explain_record(Elman().double(), (torch.randn(2, 16, E, dtype=torch.float64),), world_size=2)
    [line] = record.recurrences
    assert "serial" in line, line
    # the reason names the op that is not affine in the state (tanh) and its source line
    assert any("passed rank to rank" in m and "loop_at_" in m and "(`tanh` reads it at " in m
               and "test_recurrence_loops.py" in m for m in caplog.messages), caplog.messages


def test_initial_states_shaped_after_a_token_fetch_no_row() -> None:
    """``zeros_like(k[:, 0])`` reads only a shape: the rewrite takes a local token, no position is
    fetched from its owner (no ``where(position == 0)`` + all-reduce, three times per layer)."""
    from cp_compile.tools.explain import explain_model

    rep = explain_model(Wkv().double(), (torch.randn(2, 16, E, dtype=torch.float64),), world_size=2)
    assert not rep.fallbacks, rep.fallbacks
    assert not [n for n in rep.after.graph.nodes if n.target is torch.where], rep.after.code
    assert sum(n.target is torch.zeros_like for n in rep.after.graph.nodes) == 3, rep.after.code



def test_runs_that_would_cut_a_block_are_refused_by_name() -> None:
    """Blocks of 4 and runs of 3 tokens (S = 12 on 2 ranks, zig-zag): the runs would cut the model's
    blocks, so the kernel is gathered (exact) and the WARNING says why and which lengths work."""
    record = explain_record(BlockLoop().double(), (torch.randn(2, 12, E, dtype=torch.float64),), world_size=2)
    assert not record.recurrences, record.recurrences
    [why] = [f for f in record.fallbacks if "loop_at_" in f]
    assert "chunks of 4 tokens" in why and "runs hold 3" in why and "multiple of 16" in why, why
    ok = explain_record(BlockLoop().double(), (torch.randn(2, 16, E, dtype=torch.float64),), world_size=2)
    assert not ok.fallbacks and len(ok.recurrences) == 1, (ok.fallbacks, ok.recurrences)


def _per_head(seq: int) -> dict:
    ref_model, cp_model = twin_models(lambda: PerHead().double())
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,))  # every attention the ring
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "recurrences": [r.recurrences for r in backend.records], "rings": [r.rings for r in backend.records]}


@pytest.mark.multirank
def test_a_loop_over_heads_is_left_to_the_ring(ranks) -> None:
    """A loop whose steps hold attention (over heads, not tokens) is not folded: each head's attention is
    the ring, exact, and no recurrence is recorded."""
    for rank, r in enumerate(ranks.run(2, _per_head, 16, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert r["recurrences"] == [[]] and r["rings"] == [4], (rank, r)

