"""Registered recurrent kernels run by state passing: exact, 1/N of the tokens per rank, never gathered.

A kernel that takes the state entering the sequence and returns the state leaving it (flash-linear-
attention's ``chunk_gla``, mamba_ssm's ``mamba_chunk_scan_combined``, a user's own) is declared with
:func:`cp_compile.register_recurrence`; ring_cp then runs it on each rank's runs of tokens
(cp_compile.passes.propagate.rules.recurrence)::

    x (B, S, E) Sharded(1) ─ proj ─> q, k, v, g (B, S/N, H, D) ─ per run j: kernel from 0 (c_j), probe (M_j)
        ─ one gather_stack of N·k (M, c) ─ compose in global order ─ kernel from h_in_j ─> o Sharded(1)

The stand-ins (tests/recurrent_kernels.py) run their recurrence step by step; the reference is the
same model on one process, eager, on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import grad_errors, loss_through_ring_cp, rel, twin_models
from recurrent_kernels import delta_rule, gla, registered, ssd, tanh_rnn

E, H, D = 8, 2, 4
TOL = 1e-5


class Mixer(nn.Module):
    """One recurrent layer on kernel ``kind``: projections, a causal depthwise conv (the halo rule) on
    the drive, the kernel, an output projection; optionally a causal attention layer after it
    (a hybrid), and a passed-in initial state whose final state the loss reads too (a cache's)."""

    def __init__(self, kind: str, attention: bool = False, with_h0: bool = False) -> None:
        super().__init__()
        self.kind, self.attention, self.with_h0 = kind, attention, with_h0
        self.inp = nn.Linear(E, 5 * H * D)
        self.conv = nn.Conv1d(H * D, H * D, 3, groups=H * D, padding=2)
        self.out = nn.Linear(H * D, E)
        self.qkv = nn.Linear(E, 3 * E)
        self.h0 = nn.Parameter(torch.randn(1, H, D, D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, g, a = self.inp(x).view(b, s, 5, H, D).unbind(2)  # (B, S, H, D) each
        v = F.silu(self.conv(v.reshape(b, s, H * D).transpose(1, 2))[..., :s]).transpose(1, 2).reshape(b, s, H, D)
        g = -F.softplus(g)  # a log decay <= 0
        h0 = self.h0.expand(b, H, D, D) if self.with_h0 else None
        final = self.with_h0  # a cache's run: the state in and the state out (both read by the loss)
        if self.kind == "gla":
            o, hT = gla(q, k / D, v, g, initial_state=h0, output_final_state=final)
        elif self.kind == "ssd":
            dt = F.softplus(a[..., 0])  # (B, S, H)
            o, hT = ssd(v, dt, -torch.arange(1, H + 1.0), k, q, initial_state=h0, return_final_states=final)
        elif self.kind == "delta_rule":
            o, hT = delta_rule(q, F.normalize(k, dim=-1), v, g[..., 0], torch.sigmoid(a[..., 0]), initial_state=h0,
                               output_final_state=final)
        else:
            o, hT = tanh_rnn(v, torch.sigmoid(a), h0[..., 0] if h0 is not None else None)
        y = self.out(o.reshape(b, s, H * D)) + x
        if self.attention:
            qq, kk, vv = self.qkv(y).view(b, s, 3, 2, E // 2).permute(2, 0, 3, 1, 4)
            y = y + F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(1, 2).reshape(b, s, E)
        return y.square().mean() + (hT.square().mean() if final else 0)


def _compare(kind: str, attention: bool, with_h0: bool, seq: int, load_balance: str, dtype=torch.float64) -> dict:
    with registered(kind) as (spec,):
        ref_model, cp_model = twin_models(lambda: Mixer(kind, attention, with_h0).to(dtype))
        x = torch.randn(2, seq, E, generator=torch.Generator().manual_seed(1), dtype=dtype)
        ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), attention=attention,
                                                 load_balance=load_balance)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "recurrences": [r.recurrences for r in backend.records],
            "calls": kernel_runs(backend, spec.target), "gathers": gathers(backend)}


def kernel_runs(backend, kernel) -> list:
    """The token count each call of ``kernel`` (its graph function) in the rewritten graphs is given: the length of the
    ``narrow`` its first sequence argument comes from, or None where it is given anything else."""
    runs = []
    for gm in backend.graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is kernel:
                x = next(a for a in (*n.args, *n.kwargs.values()) if isinstance(a, torch.fx.Node))
                if x.op == "call_function" and x.args and isinstance(x.args[0], torch.fx.Node):
                    x = x.args[0]  # the probe's zeroed drive: zeros like the run's narrow
                runs.append(x.args[3] if x.op == "call_method" and x.target == "narrow" else None)
    return runs


def gathers(backend) -> int:
    """Whole-sequence all-gathers in the rewritten graphs."""
    from cp_compile.graph_ops import gather_seq

    return sum(n.target is gather_seq for gm in backend.graphs for n in gm.graph.nodes)


@pytest.mark.multirank
@pytest.mark.parametrize("kind,attention,with_h0,world,seq,lb", [
    ("gla", True, False, 2, 16, "zigzag"),
    pytest.param("gla", False, True, 4, 15, "contiguous", marks=pytest.mark.slow),
    ("ssd", False, True, 2, 15, "contiguous"),
    pytest.param("ssd", True, False, 4, 16, "zigzag", marks=pytest.mark.slow),
    ("delta_rule", True, True, 2, 17, "zigzag"),
    pytest.param("delta_rule", False, False, 4, 16, "contiguous", marks=pytest.mark.slow),
    ("tanh_rnn", False, False, 2, 16, "zigzag"),
    pytest.param("tanh_rnn", True, True, 4, 16, "contiguous", marks=pytest.mark.slow),
])
def test_registered_recurrence_is_exact(ranks, kind, attention, with_h0, world, seq, lb) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, kind, attention, with_h0, seq, lb, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"], (rank, r)
        assert r["recurrences"] and all(len(x) == 1 for x in r["recurrences"]), (rank, r)
        assert r["gathers"] == 0, (rank, r)
        runs = 2 if lb == "zigzag" else 1
        length = -(-seq // (world * runs))  # a run's tokens, the last one padded
        per_run = 1 if kind == "tanh_rnn" else 3  # serial: the run once; else from 0, the probe, from h_in
        assert r["calls"] and set(r["calls"]) == {length}, (rank, r["calls"], length)
        assert len(r["calls"]) == (per_run * runs if kind != "tanh_rnn" else runs), (rank, r["calls"])
