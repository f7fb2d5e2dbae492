"""Chunk loops that store the state entering each chunk, read back after the loop (xLSTM's mLSTM form).

    cs = zeros(B, H, (n + 1) * K, V)                       # one block of K rows per chunk, and one more
    for i in range(n):
        cs[:, :, i*K:(i+1)*K] = C                          # the state entering chunk i
        C = exp(g_tot[:, :, i]) * C + k[:, :, i*C:(i+1)*C]ᵀ @ v[...]   # one entry of the chunk totals,
    cs[:, :, -K:] = C                                      #   one chunk of the tokens, per step
    out = f(q.view(B, H, n, C, K), cs[:, :, :-K].view(B, H, n, K, V))  # per chunk

-> one LoopKernel whose per-step outputs are its entering states: ``cs[:, :, :-K]`` is the kernel's
   item, Sharded(2, inner=K, chunk=C) (K rows per chunk of C tokens), its view Sharded(2, chunk=C);
   the block written after the loop stays on the buffer. The step reads the gate totals by entry
   (C tokens each) and the keys by chunks of C tokens: both advance C tokens per step.

Styles, written the way a model library writes them:

* ``mlstm``: xLSTM's stabilised chunkwise mLSTM: states (C, n, m), m a running max, so the step is not
  affine in its state and the state is relayed rank to rank (serial, warned); the buffer has n + 1
  blocks, the last written after the loop;
* ``gla``: the same store of entering states without a stabiliser, into a (B, H, n, K, V) buffer
  one entry per chunk (``cs[:, :, i] = C``), no block after the loop: elementwise affine, parallel.

Reference: the same model eager on one process, fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import compare_recurrent_model, explain_record

E, H, K, V = 8, 2, 4, 3  # width, heads, key dim, value dim
TOL = 1e-5


def _gates(ig: torch.Tensor, fg: torch.Tensor, c: int):
    """(B, H, S) input and forget gate logits -> per chunk: the forget gates' running sums from the
    chunk's start (B, H, n, C), each token's log weight in its chunk's total (B, H, n, C), the chunk's
    total log decay (B, H, n)."""
    b, h, s = ig.shape
    ig, fg = ig.view(b, h, s // c, c), fg.view(b, h, s // c, c)
    fcum = F.logsigmoid(fg).cumsum(-1)
    return fcum, fcum[..., -1, None] - fcum + ig, fcum[..., -1]


def mlstm_states(k, v, fcum, a, total, c: int):
    """The stabilised states entering each chunk: (B, H, n·K, V), (B, H, n·K), (B, H, n), as xLSTM
    stores them (one block more, written after the loop, read by no one here)."""
    b, h, s, dk = k.shape
    n = s // c
    cs, ns, ms = k.new_zeros(b, h, (n + 1) * dk, v.shape[-1]), k.new_zeros(b, h, (n + 1) * dk), k.new_zeros(b, h, n + 1)
    C, N, m = k.new_zeros(b, h, dk, v.shape[-1]), k.new_zeros(b, h, dk), k.new_zeros(b, h)
    a_max = a.max(-1).values  # (B, H, n)
    for i in range(n):
        cs[:, :, i * dk:(i + 1) * dk] = C
        ns[:, :, i * dk:(i + 1) * dk] = N
        ms[:, :, i] = m
        m_next = torch.max(total[:, :, i] + m, a_max[:, :, i])  # (B, H)
        kc = k[:, :, i * c:(i + 1) * c] * torch.exp(a[:, :, i] - m_next[..., None])[..., None]  # (B, H, C, K)
        decay = torch.exp(total[:, :, i] + m - m_next)
        C = decay[..., None, None] * C + kc.transpose(-1, -2) @ v[:, :, i * c:(i + 1) * c]
        N = decay[..., None] * N + kc.sum(-2)
        m = m_next
    cs[:, :, -dk:] = C
    ns[:, :, -dk:] = N
    ms[:, :, -1] = m
    return cs[:, :, :-dk], ns[:, :, :-dk], ms[:, :, :-1]


def gla_states(k, v, fcum, a, total, c: int):
    """The same states with no stabiliser (m = 0), one buffer entry per chunk: (B, H, n, K, V), (B, H, n, K)."""
    b, h, s, dk = k.shape
    n = s // c
    cs, ns = k.new_zeros(b, h, n, dk, v.shape[-1]), k.new_zeros(b, h, n, dk)
    C, N = k.new_zeros(b, h, dk, v.shape[-1]), k.new_zeros(b, h, dk)
    for i in range(n):
        cs[:, :, i] = C
        ns[:, :, i] = N
        kc = k[:, :, i * c:(i + 1) * c] * torch.exp(a[:, :, i])[..., None]
        C = torch.exp(total[:, :, i])[..., None, None] * C + kc.transpose(-1, -2) @ v[:, :, i * c:(i + 1) * c]
        N = torch.exp(total[:, :, i])[..., None] * N + kc.sum(-2)
    return cs, ns, torch.zeros_like(total)


def chunk_outputs(q, k, v, ig, fcum, cs, ns, ms, c: int):
    """Each chunk's outputs from its entering states and its own tokens (B, H, S, V)."""
    b, h, s, dk = q.shape
    n = s // c
    qc, kc, vc = q.view(b, h, n, c, dk) * dk ** -0.5, k.view(b, h, n, c, dk), v.view(b, h, n, c, -1)
    cs, ns = cs.reshape(b, h, n, dk, -1), ns.reshape(b, h, n, dk)
    tril = torch.ones(c, c, dtype=torch.bool).tril()
    logd = (fcum[..., :, None] - fcum[..., None, :] + ig.view(b, h, n, 1, c)).masked_fill(~tril, float("-inf"))
    m_in = fcum + ms[..., None]  # (B, H, n, C)
    m_all = torch.maximum(m_in, logd.max(-1).values)
    scores = (qc @ kc.transpose(-1, -2)) * torch.exp(logd - m_all[..., None])  # (B, H, n, C, C)
    qg = qc * torch.exp(m_in - m_all)[..., None]
    num = qg @ cs + scores @ vc
    den = qg @ ns[..., None] + scores.sum(-1, keepdim=True)
    out = num / (torch.maximum(den.abs(), torch.exp(-m_all)[..., None]) + 1e-6)
    return out.reshape(b, h, s, -1)


class ChunkStates(nn.Module):
    """One chunkwise mixer that stores its chunks' entering states, and a loss."""

    def __init__(self, chunk: int = 4, style: str = "mlstm") -> None:
        super().__init__()
        self.chunk, self.style = chunk, style
        self.proj = nn.Linear(E, H * (2 * K + V + 2))
        self.out = nn.Linear(H * V, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, ig, fg = self.proj(x).view(b, s, H, -1).transpose(1, 2).split([K, K, V, 1, 1], -1)
        ig, fg = ig[..., 0], fg[..., 0]  # (B, H, S)
        fcum, a, total = _gates(ig, fg, self.chunk)
        states = mlstm_states if self.style == "mlstm" else gla_states
        cs, ns, ms = states(k, v, fcum, a, total, self.chunk)
        y = chunk_outputs(q, k, v, ig, fcum, cs, ns, ms, self.chunk)
        h = x + self.out(y.transpose(1, 2).reshape(b, s, H * V))
        return h.square().mean()


def _compare(style: str, chunk: int, seq: int, load_balance: str) -> dict:
    x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return compare_recurrent_model(lambda: ChunkStates(chunk, style).double(), x, False, load_balance)


@pytest.mark.multirank
@pytest.mark.parametrize("style,world,chunk,seq,lb", [
    ("mlstm", 2, 4, 16, "zigzag"),  # runs of 4 tokens: one chunk each
    ("gla", 2, 3, 24, "contiguous"),  # an odd chunk size; runs of 12: four chunks each
    pytest.param("mlstm", 4, 3, 48, "contiguous", marks=pytest.mark.slow),
    pytest.param("gla", 4, 4, 32, "zigzag", marks=pytest.mark.slow),
])
def test_a_loop_storing_its_entering_states_is_exact_and_never_gathered(ranks, style, world, chunk, seq, lb) -> None:
    want = "rank to rank (serial)" if style == "mlstm" else "elementwise maps"
    for rank, r in enumerate(ranks.run(world, _compare, style, chunk, seq, lb, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"] and r["gathers"] == 0, (rank, r)
        [[line]] = r["recurrences"]
        assert line.startswith("loop_at_") and want in line, (rank, line)


def test_explain_names_the_stored_states_loop_and_its_relay(caplog) -> None:
    """The stabiliser's max makes the step not affine in its state: explain says it is relayed, and
    a WARNING names the max; the states stored in the buffer gather nothing."""
    with caplog.at_level("WARNING", logger="cp_compile"):
        record = explain_record(ChunkStates(4, "mlstm").double(), (torch.randn(2, 16, E, dtype=torch.float64),))
    assert not record.fallbacks, record.fallbacks
    [line] = record.recurrences
    assert "rank to rank (serial)" in line, line
    assert any("`max` reads it" in m and "passed rank to rank" in m for m in caplog.messages), caplog.messages


def test_a_buffer_read_across_the_loops_entries_and_the_rest_keeps_the_loop_as_traced() -> None:
    """``cs.sum()`` reads the blocks the loop wrote and the one written after it in one value: no
    item stands for that, so the loop is not folded; with no other mixer, the graph is left whole
    (warned by the backend)."""
    class ReadsAll(ChunkStates):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            _, k, v, ig, fg = self.proj(x).view(b, s, H, -1).transpose(1, 2).split([K, K, V, 1, 1], -1)
            fcum, a, total = _gates(ig[..., 0], fg[..., 0], self.chunk)
            n, dk = s // self.chunk, K
            cs, C = k.new_zeros(b, H, (n + 1) * dk, V), k.new_zeros(b, H, dk, V)
            for i in range(n):
                cs[:, :, i * dk:(i + 1) * dk] = C
                kc = k[:, :, i * self.chunk:(i + 1) * self.chunk] * torch.exp(a[:, :, i])[..., None]
                C = torch.exp(total[:, :, i])[..., None, None] * C + kc.transpose(-1, -2) @ v[
                    :, :, i * self.chunk:(i + 1) * self.chunk]
            cs[:, :, -dk:] = C
            return cs.sum()

    record = explain_record(ReadsAll(4, "gla").double(), (torch.randn(2, 16, E, dtype=torch.float64),))
    assert not record.recurrent_calls and not record.shard_inputs, record
    assert "compiled unchanged" in record.summary(), record.summary()
