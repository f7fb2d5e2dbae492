"""Determinism: identical inputs give bit-identical outputs and gradients, whatever the timing.

The ring merges K/V blocks in a fixed order (ring step order) and sums dK/dV in a
fixed order (the accumulator's path, which the all-to-all path reproduces), so when
the blocks *arrive* must not change a single bit. tests/test_ring_exact.py already
checks two back-to-back runs and p2p against allgather; here the arrival order is
shaken: a stand-in kernel (the aten kernel plus a random sleep per call, different
on every rank and every run) makes ranks finish their steps at different times.

* the ring op, p2p and allgather, 2 and 4 ranks, fp32 and bf16, causal and not:
  out, dq, dk, dv bitwise equal with and without jitter (two jitter seeds);
* a model compiled with ``ring_cp`` (aot_eager), compiled afresh for each run: loss
  and every parameter gradient bitwise equal across runs (with and without jitter),
  and across ranks (replicated weights must stay in sync bit for bit).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import models

import cp_compile
from checks import explain_record, ring_mismatches
from cp_compile.kernels import register_kernel
from cp_compile.kernels.aten import AtenKernel

JITTER = "test_jitter_aten"


class JitterKernel:
    """The aten kernel after a random sleep of up to ``max_s`` seconds per call."""

    name = JITTER

    def __init__(self, seed: int, max_s: float = 0.01) -> None:
        self.rng, self.max_s, self.inner = random.Random(seed), max_s, AtenKernel()

    def supports(self, device, dtype):
        return self.inner.supports(device, dtype)

    def forward(self, q, k, v, *, causal, scale):
        time.sleep(self.rng.uniform(0, self.max_s))
        return self.inner.forward(q, k, v, causal=causal, scale=scale)

    def backward(self, *args, **kwargs):
        time.sleep(self.rng.uniform(0, self.max_s))
        return self.inner.backward(*args, **kwargs)


def _jitter(seed: int) -> str:
    register_kernel(JitterKernel(1000 * seed + dist.get_rank()), replace=True)
    return JITTER


def _op_runs(dtype_name: str):
    """Per case: (out, dq, dk, dv) without jitter and with two jitter seeds, for both rotates."""
    dtype = getattr(torch, dtype_name)
    results = []
    for i, (causal, lb) in enumerate(((True, "zigzag"), (False, "striped"), (True, "contiguous"))):
        g = torch.Generator().manual_seed(100 + i)
        full = [torch.randn(2, h, 64, 32, generator=g) for h in (4, 2, 2, 4)]  # q, k, v, dout
        runs = {}
        for rotate in ("p2p", "allgather"):
            kernels = (("plain", lambda: "aten"), ("jitter1", lambda: _jitter(1)), ("jitter2", lambda: _jitter(2)))
            for tag, kernel in kernels:
                q, k, v, do = (cp_compile.shard(t, 2, load_balance=lb).to(dtype) for t in full)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out = cp_compile.ring_attention(q, k, v, causal=causal, load_balance=lb, rotate=rotate, kernel=kernel())
                out.backward(do)
                runs[(rotate, tag)] = (out.detach(), q.grad, k.grad, v.grad)
        results.append(runs)
    return results


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_op_bitwise_identical_whatever_the_timing(ranks, world, dtype_name):
    bad = []
    for rank, per_case in enumerate(ranks.run(world, _op_runs, dtype_name, timeout=300)):
        for i, runs in enumerate(per_case):
            ref = runs[("p2p", "plain")]
            for key, got in runs.items():
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                    if not torch.equal(a, b):
                        bad.append(f"rank {rank} case {i} {key}: {name} differs from p2p/plain")
    assert not bad, "\n".join(bad)


def _model_runs():
    """Loss and parameter gradients of three fresh compilations: plain, jitter 1, jitter 2 (each
    checked to have made every attention the ring: else bitwise equality would test nothing)."""
    runs = []
    for seed in (0, 1, 2):
        torch._dynamo.reset()
        model, inputs = models.llama_factory(seq_len=61)  # padded: 61 is not a multiple of 4
        kernel = "aten" if seed == 0 else _jitter(seed)
        explained = explain_record(model, inputs, world_size=dist.get_world_size(), kernel=kernel)
        backend = cp_compile.RingCP(inner="aot_eager", kernel=kernel)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss = compiled(*inputs)
        loss.backward()
        assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
        assert not (rings := ring_mismatches(backend, len(model.layers))), rings  # one attention a layer
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    return runs


@pytest.mark.slow
def test_compiled_model_bitwise_identical_across_runs_and_ranks(ranks):
    per_rank = ranks.run(2, _model_runs, timeout=300)
    ref_loss, ref_grads = per_rank[0][0]
    for rank, runs in enumerate(per_rank):
        for i, (loss, grads) in enumerate(runs):
            assert torch.equal(loss, ref_loss), (rank, i, loss, ref_loss)
            for j, (a, b) in enumerate(zip(grads, ref_grads)):
                assert torch.equal(a, b), f"rank {rank} run {i}: gradient {j} differs (max {(a - b).abs().max():.3g})"
