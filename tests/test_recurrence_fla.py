"""A real kernel of the field under state passing: flash-linear-attention's ``fused_recurrent_gla``,
its Triton code run by Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py; no GPU here).

The kernel cannot run on fake tensors, so registration keeps it one opaque op of the graphs with
shapes from ``fake=`` (cp_compile.recurrence.opaque); each rank runs the real kernel on its runs of
tokens. Reference: the same model on one process, eager, the kernel on the whole sequence.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fla.ops.gla import fused_recurrent_gla

from checks import grad_errors, loss_through_ring_cp, rel, twin_models

E, K = 16, 16  # one head of width 16: Triton's smallest tile
TOL = 1e-5


def gla_fake(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False, reverse=False,
             cu_seqlens=None, **kwargs):
    """fused_recurrent_gla's result shapes: o like v, the final state (B, H, K, V) in fp32."""
    b, _, h, dk = k.shape
    final = v.new_empty(b, h, dk, v.shape[-1], dtype=torch.float32) if output_final_state else None
    return torch.empty_like(v), final


CONTRACT = dict(seq_args={"q": 1, "k": 1, "v": 1, "gk": 1}, outputs={0: 1}, initial_state="initial_state",
                final_state=1, final_state_flag="output_final_state", transition="elementwise", drive=("v",),
                when={"gv": None, "reverse": False, "cu_seqlens": None}, fake=gla_fake)


@contextlib.contextmanager
def _first_config() -> Iterator[None]:
    """fla's kernels autotune, and the interpreter has no device to time configs on: take the first."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    try:
        yield
    finally:
        Autotuner.prune_configs = prune


class GLALayer(nn.Module):
    """Projections, a log-sigmoid gate, fla's recurrent GLA from a learned state, an output projection;
    the loss reads the output and the final state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(E, 4 * K)
        self.out = nn.Linear(K, E)
        self.h0 = nn.Parameter(torch.randn(1, 1, K, K) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, g = self.inp(x).view(b, s, 4, 1, K).unbind(2)  # (B, S, 1, K) each
        o, h = fused_recurrent_gla(q, k, v, gk=F.logsigmoid(g) / 16, initial_state=self.h0.expand(b, 1, K, K),
                                   output_final_state=True)
        return self.out(o.reshape(b, s, K)).square().mean() + h.square().mean()


def _compare(seq: int, load_balance: str) -> dict:
    import cp_compile

    with _first_config():
        spec = cp_compile.register_recurrence(fused_recurrent_gla, **CONTRACT)
        try:
            ref_model, cp_model = twin_models(GLALayer)
            x = torch.randn(1, seq, E, generator=torch.Generator().manual_seed(0))
            ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (x,), attention=False,
                                                     load_balance=load_balance)
        finally:
            cp_compile.unregister_recurrence(fused_recurrent_gla)
    calls = sum(n.target is spec.target for gm in backend.graphs for n in gm.graph.nodes)
    return {"loss": rel(out.detach(), ref.detach()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "recurrences": [r.recurrences for r in backend.records], "calls": calls}


@pytest.mark.multirank
@pytest.mark.parametrize("world,seq,lb", [
    (2, 30, "zigzag"),
    pytest.param(4, 32, "contiguous", marks=pytest.mark.slow),
])
def test_fla_fused_recurrent_gla_is_state_passed_exactly(ranks, world, seq, lb) -> None:
    runs = 2 if lb == "zigzag" else 1
    for rank, r in enumerate(ranks.run(world, _compare, seq, lb, timeout=300)):
        assert r["loss"] <= TOL and max(r["grads"].values()) <= TOL, (rank, r)
        assert not r["fallbacks"] and len(r["recurrences"][0]) == 1, (rank, r)
        assert r["calls"] == 3 * runs, (rank, r)  # per run: from zero, the probe, from the incoming state


def test_a_call_outside_the_contract_is_gathered_with_the_reason() -> None:
    """``reverse=True`` runs the recurrence from the end: not the declared contract (when=), so the
    call is run on the gathered sequence and explain says why."""
    import cp_compile
    from cp_compile.tools.explain import explain_model

    class Reverse(GLALayer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v, g = self.inp(x).view(*x.shape[:2], 4, 1, K).unbind(2)
            return fused_recurrent_gla(q, k, v, gk=F.logsigmoid(g), reverse=True)[0].square().mean()

    cp_compile.register_recurrence(fused_recurrent_gla, **CONTRACT)
    try:
        with _first_config():
            record = explain_model(Reverse(), (torch.randn(1, 32, E),), world_size=2).ctx.record
    finally:
        cp_compile.unregister_recurrence(fused_recurrent_gla)
    assert not record.recurrences and len(record.fallbacks) == 1, record
    assert "reverse=True" in record.fallbacks[0] and "reverse=False only" in record.fallbacks[0]
