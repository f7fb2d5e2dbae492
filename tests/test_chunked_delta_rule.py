"""Chunked linear attention and the chunked (gated) delta rule under ring_cp: loops over chunks.

    q = x.view(B, H, S // C, C, K)                     -> Sharded(2, chunk=C): this rank's chunks
    a[..., i, :i] = ...  (the in-chunk solve, by rows)  -> the same write on this rank's chunks
    for i in range(S // C): q[:, :, i] ... out[:, :, i] = ...; h = A_i @ h + b_i
                                                       -> one LoopKernel, state-passed with (K, K) maps

Styles, each written the way a model library writes it:

* ``rows``: Kimi Delta Attention's torch path (a per-channel gate, the in-chunk solve by writes into
  the matrix one row at a time, outputs written into ``zeros_like`` chunk by chunk);
* ``stack``: Gated DeltaNet (one gate per head, the solve by forward substitution into a list, the
  outputs appended and stacked);
* ``gla``: gated linear attention (no delta rule: the state is only decayed and added to, an
  elementwise transition).

The delta rule's state update ``h * exp(g_last) + kᵀ @ (v - w @ h)`` is affine in h through a
matrix on dim -2, so each run's map is (K, K) and the runs combine in one all-gather.
Reference: the same model eager on one process, fp64.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from checks import compare_recurrent_model, explain_record, grad_errors, loss_through_ring_cp, rel, twin_models

E, H, K = 8, 2, 4  # width, heads, key dim (the value dim is the model's, to test V < K and V > K)
TOL = 1e-5


def in_chunk_solve_rows(a: torch.Tensor) -> torch.Tensor:
    """(I - A)^-1 - I for strictly lower A (…, C, C), by writing each row from the ones above it."""
    c = a.shape[-1]
    for i in range(1, c):
        row, above = a[..., i, :i].clone(), a[..., :i, :i].clone()
        a[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
    return a


def in_chunk_solve_stack(a: torch.Tensor) -> torch.Tensor:
    """The same by forward substitution, the rows collected in a list."""
    c = a.shape[-1]
    rows = []
    for i in range(c):
        r = a[..., i, :]  # (…, C)
        for j in range(i):
            r = r + a[..., i, j, None] * rows[j]
        rows.append(r)
    return torch.stack(rows, -2)


def delta_rule_chunks(q, k, v, g, beta, c: int, style: str) -> torch.Tensor:
    """q, k (B, H, S, K), v (B, H, S, V), g (B, H, S, K or 1) log decays, beta (B, H, S) -> (B, H, S, V)."""
    b, h, s, dk = k.shape
    q, k, v, g = [t.reshape(b, h, s // c, c, t.shape[-1]) for t in (q, k, v, g)]  # (B, H, n, C, ·)
    beta = beta.reshape(b, h, s // c, c)
    g = g.cumsum(-2)  # from the chunk's start, the token included
    later = torch.ones(c, c, dtype=torch.bool).triu(1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(later[..., None], float("-inf")).exp()  # (…, C, C, ·)
    kb, vb = k * beta[..., None], v * beta[..., None]
    a = -(kb.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).masked_fill(~later.T, 0)  # (…, C, C)
    solve = in_chunk_solve_rows if style == "rows" else in_chunk_solve_stack
    t = solve(a) + torch.eye(c, dtype=a.dtype)
    w, u = t @ (kb * g.exp()), t @ vb  # (B, H, n, C, K), (B, H, n, C, V)
    state = q.new_zeros(b, h, dk, v.shape[-1])  # (B, H, K, V)
    out = torch.zeros_like(u) if style == "rows" else None
    outs = []
    for i in range(s // c):
        qi, ki, gi = q[:, :, i], k[:, :, i], g[:, :, i]
        inner = (qi.unsqueeze(-2) * ki.unsqueeze(-3) * decay[:, :, i]).sum(-1).masked_fill(later, 0)  # (…, C, C)
        vi = u[:, :, i] - w[:, :, i] @ state
        oi = (qi * gi.exp()) @ state + inner @ vi  # (B, H, C, V)
        if out is not None:
            out[:, :, i] = oi
        else:
            outs.append(oi)
        state = state * gi[:, :, -1].exp().unsqueeze(-1) + (ki * (gi[:, :, -1:] - gi).exp()).transpose(-1, -2) @ vi
    out = out if out is not None else torch.stack(outs, 2)
    return out.reshape(b, h, s, -1)


def gla_chunks(q, k, v, g, c: int) -> torch.Tensor:
    """Gated linear attention by chunks: h' = exp(g_last) h + Σ_t exp(g_last - g_t) k_t v_tᵀ."""
    b, h, s, dk = k.shape
    q, k, v, g = [t.reshape(b, h, s // c, c, t.shape[-1]) for t in (q, k, v, g)]
    g = g.cumsum(-2)
    later = torch.ones(c, c, dtype=torch.bool).triu(1)
    state, outs = q.new_zeros(b, h, dk, v.shape[-1]), []
    for i in range(s // c):
        qi, ki, vi, gi = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i]
        decay = (gi.unsqueeze(-2) - gi.unsqueeze(-3)).masked_fill(later[..., None], float("-inf")).exp()
        scores = (qi.unsqueeze(-2) * ki.unsqueeze(-3) * decay).sum(-1)  # (B, H, C, C)
        outs.append((qi * gi.exp()) @ state + scores @ vi)
        state = gi[:, :, -1:].exp().transpose(-1, -2) * state + (ki * (gi[:, :, -1:] - gi).exp()).transpose(-1, -2) @ vi
    return torch.cat([o.unsqueeze(2) for o in outs], 2).reshape(b, h, s, -1)


class LinearMixer(nn.Module):
    """One chunked linear-attention mixer (+ an optional causal attention layer) and a loss."""

    def __init__(self, chunk: int = 4, style: str = "rows", v_dim: int = 3, attention: bool = False) -> None:
        super().__init__()
        self.chunk, self.style, self.v_dim, self.attention = chunk, style, v_dim, attention
        gates = K if style != "stack" else 1  # per channel (KDA, GLA) or per head (Gated DeltaNet)
        self.proj = nn.Linear(E, H * (2 * K + v_dim + gates + 1))
        self.out = nn.Linear(H * v_dim, E)
        self.qkv = nn.Linear(E, 3 * E)
        self.gates = gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, g, beta = self.proj(x).view(b, s, H, -1).transpose(1, 2).split(
            [K, K, self.v_dim, self.gates, 1], -1)  # (B, H, S, ·)
        k = F.normalize(k, dim=-1)
        g = -F.softplus(g)  # log decays <= 0
        if self.style == "gla":
            y = gla_chunks(q, k, v, g, self.chunk)
        else:
            y = delta_rule_chunks(q, k, v, g, torch.sigmoid(beta[..., 0]), self.chunk, self.style)
        h = x + self.out(y.transpose(1, 2).reshape(b, s, H * self.v_dim))
        if self.attention:
            q, k, v = self.qkv(h).view(b, s, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
            h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, E)
        return h.square().mean()


def _compare(style: str, seq: int, load_balance: str, v_dim: int, attention: bool) -> dict:
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return compare_recurrent_model(lambda: LinearMixer(4, style, v_dim, attention).double(), x, attention,
                                   load_balance)


@pytest.mark.multirank
@pytest.mark.parametrize("style,world,seq,lb,v_dim,attention", [
    ("rows", 2, 32, "zigzag", 3, False),  # runs of 8 tokens: two chunks each; V < K (two column blocks)
    ("stack", 2, 16, "contiguous", 5, True),  # runs of 8 and the ring; V > K
    ("gla", 2, 16, "zigzag", 3, False),  # runs of 4: one chunk each
    pytest.param("rows", 4, 32, "contiguous", 4, True, marks=pytest.mark.slow),
    pytest.param("stack", 4, 32, "zigzag", 3, False, marks=pytest.mark.slow),
])
def test_a_chunked_delta_rule_is_exact_and_never_gathered(ranks, style, world, seq, lb, v_dim, attention) -> None:
    want = "elementwise" if style == "gla" else "matrix"
    for rank, r in enumerate(ranks.run(world, _compare, style, seq, lb, v_dim, attention, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"] and r["gathers"] == 0, (rank, r)
        [[line]] = r["recurrences"]
        assert line.startswith("loop_at_") and f"state passing, {want} maps" in line, (rank, line)


def _bytes_sent(seq: int) -> dict:
    import cp_compile
    from cp_compile import traffic

    torch.manual_seed(0)
    model = LinearMixer(4, "rows", 3).double()
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(x).backward()  # compile
    with traffic.measure() as sent:
        compiled(x).backward()
    return {"sent": dict(sent), "record": backend.records[-1].recurrences}


@pytest.mark.slow
@pytest.mark.multirank
def test_the_state_exchange_bytes_are_counted_where_sent_and_do_not_grow_with_s(ranks) -> None:
    """Each rank receives N·k (map, state) summaries per step, and sends back as many gradients:
    (B, H, K, K) + (B, H, K, V) fp64 per run, 2 ranks × 2 zig-zag runs, at S = 32 and 64 alike."""
    want = 2 * 2 * (2 * H * K * K + 2 * H * K * 3) * 8  # = 3584 B
    for seq in (32, 64):
        for rank, r in enumerate(ranks.run(2, _bytes_sent, seq, timeout=300)):
            assert r["sent"] == {"state exchange": want, "state exchange grad": want}, (seq, rank, r)
            assert f"{want} B received per rank" in r["record"][0], (seq, rank, r["record"])


def test_explain_names_the_loop_its_matrix_maps_and_bytes() -> None:
    record = explain_record(LinearMixer(4, "rows", 3).double(), (torch.randn(2, 32, E, dtype=torch.float64),),
                            world_size=4, rank=1)
    assert not record.fallbacks, record.fallbacks
    [line] = record.recurrences
    state, maps = 2 * H * K * 3, 2 * H * K * K  # (B, H, K, V) states and (B, H, K, K) maps
    assert "matrix maps" in line and f"state (2, {H}, {K}, 3)" in line, line
    assert f"{4 * 2 * (state + maps) * 8} B received per rank" in line, line  # N·k = 4·2 runs, fp64


def test_runs_that_would_cut_a_chunk_are_refused_by_name() -> None:
    """Chunks of 4 and zig-zag runs of 3 tokens (S = 12 on 2 ranks): gathered, exact, and warned."""
    record = explain_record(LinearMixer(4, "stack", 3).double(), (torch.randn(2, 12, E, dtype=torch.float64),),
                            world_size=2)
    why = [f for f in record.fallbacks if "not whole chunks of 4" in f]
    assert why and "runs of 3 tokens" in why[0], record.fallbacks


def _step(fn, *example):
    gm = fx.symbolic_trace(fn)
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example):
        node.meta["example_value"] = value
    for node in gm.graph.nodes:  # example values of every node, as Dynamo leaves them
        if node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda a: a.meta["example_value"])
            node.meta["example_value"] = node.target(*args)
    return gm


def test_a_step_is_a_matrix_only_when_every_scaling_is_constant_along_the_columns() -> None:
    from cp_compile.recurrence.loops import homogeneous_step, matrix_width, not_elementwise

    h, w, e, b = torch.randn(2, 4, 3), torch.randn(2, 4, 4), torch.rand(2, 4, 1), torch.randn(2, 4, 3)
    delta = _step(lambda h, w, e, b: (operator.add(operator.sub(operator.mul(h, e), operator.matmul(w, h)), b),),
                  h, w, e, b)
    hom = homogeneous_step(delta)
    assert hom is not None and matrix_width(delta, hom) == 3
    torch.testing.assert_close(hom(h, w, e, b), h * e - w @ h)  # b dropped: the homogeneous part
    along = _step(lambda h, w, e, b: (operator.sub(operator.mul(h, b), operator.matmul(w, h)),), h, w, e, b)
    assert homogeneous_step(along) is None  # scaled along V (b varies along the columns) and a matmul
    assert "varies along its last dim" in not_elementwise(along)
    transposed = _step(lambda h, w, e, b: (operator.matmul(h, w[..., :3, :3]),), h, w, e, b)
    assert homogeneous_step(transposed) is None  # h @ W acts on the columns: not a map on dim -2


def test_the_matrix_map_runs_the_columns_in_blocks_of_the_traced_width() -> None:
    """A run's map from the identity (K wide) equals the steps composed, for V < K and V > K."""
    from cp_compile.recurrence.loops import LoopKernel, StepOutput, StepRead, homogeneous_step

    for v in (3, 6):
        h, w, e = torch.randn(2, 4, v), torch.randn(2, 5, 4, 4) * 0.3, torch.rand(2, 5, 4, 1)
        step = _step(lambda h, w, e: (operator.sub(operator.mul(h, e), operator.matmul(w, h)),
                                      operator.mul(h, 2.0)), h, w[:, 0], e[:, 0])
        kernel = LoopKernel(step, homogeneous_step(step, 1), [StepRead(1, (slice(None), None)),
                            StepRead(1, (slice(None), None))], [StepOutput("stack", 1)], 0, "test")
        kernel.width = v
        eye = torch.eye(4).expand(2, 4, 4)
        got = kernel(x0=w, x1=e, initial_state=eye, homogeneous=True)[-1]
        want = eye
        for t in range(5):
            want = want * e[:, t] - w[:, t] @ want
        torch.testing.assert_close(got, want)


class _Writes(nn.Module):
    """Writes into a per-token buffer, then a causal attention over it."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, D)
        y = x * 2
        if self.where == "features":
            y[..., :2] = 0.0  # every position's first two features
            y[:, :, 2:4] = x[:, :, :2]  # a per-token value, the same positions
        else:
            y[:, 3] = 0.0  # one position: not this rank's alone
        q = y.view(2, -1, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def test_writes_off_the_sequence_dim_stay_sharded_and_a_write_at_a_position_is_named() -> None:
    x = torch.randn(2, 16, 8)
    assert not explain_record(_Writes("features"), (x,)).fallbacks
    why = explain_record(_Writes("position"), (x,)).fallbacks
    assert why and "setitem at some positions of the sequence only" in why[0], why



class _WritesAndChunkSplits(nn.Module):
    """Writes off the sequence dim into a per-token buffer, a split and a cat of the sequence viewed
    in chunks, then a causal attention: each rank's own positions throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, E)
        b, s, _ = x.shape
        y = self.proj(x) * 2
        y[..., :2] = 0.0  # every position's first two features
        y[:, :, 2:4] = x[:, :, :2]  # a per-token value at the same positions
        lo, hi = y.view(b, s // 4, 4, E).split(E // 2, -1)  # (B, S/4, 4, E/2) each, in chunks
        y = torch.cat([hi, lo.unbind(2)[0].unsqueeze(2).expand_as(lo)], -1).reshape(b, s, E)
        q = y.view(b, s, 2, E // 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().mean()


def _writes_compare(load_balance: str) -> dict:
    ref_model, cp_model = twin_models(lambda: _WritesAndChunkSplits().double())
    x = torch.randn(2, 16, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), load_balance=load_balance)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks}


@pytest.mark.multirank
@pytest.mark.parametrize("world,lb", [(2, "zigzag"), pytest.param(4, "contiguous", marks=pytest.mark.slow)])
def test_writes_and_splits_of_chunks_are_exact_without_a_gather(ranks, world, lb) -> None:
    for rank, r in enumerate(ranks.run(world, _writes_compare, lb, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"], (rank, r)
