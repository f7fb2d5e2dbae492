"""Differential fuzzing: the ring op and generated models against one process.

Hypothesis draws configurations; each runs context-parallel (gloo, world size 1, 2
or 4) and in a single process on the full sequence, and must agree:

* the ring op: batch, heads / kv-heads (MHA, GQA, MQA), head dim, dtype (fp32,
  bf16), causal or not, softmax scale, layout, rotation, kernel, world size and the
  sequence length (any length the layout can split). out, dq, dk, dv against fp64
  SDPA: fp32 <= 1e-5 relative; bf16 <= 2x single-process bf16 SDPA's error (and
  < 2e-2), as in tests/test_ring_exact.py.
* small generated models (examples/models.py: Llama with any GQA style, GPT-2, the
  encoder) with random widths, heads, depth, batch and *any* sequence length (most
  need padding), compiled with ``ring_cp`` (inner aot_eager): loss and every
  parameter gradient within 1e-5 relative of the eager single-process run (each
  gradient relative to its own norm: none of these models has a gradient that is
  zero in exact arithmetic, checked in fp64 over their configurations), every
  attention of that run the ring, and ``cp-compile explain``'s record of every one
  equal to the runtime's (``RingCP.records``; world size 1 compiles unchanged and
  records nothing).

Profiles (environment variable ``HYPOTHESIS_PROFILE``):

* ``ci`` (default): derandomized (the same examples on every run), 24 ring-op and 6
  model examples, about a minute on 2 cores;
* ``long``: random, 400 ring-op and 60 model examples, failures kept in Hypothesis'
  example database for replay; for local runs:
  ``HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_fuzz.py``.

World size 1 runs in the pytest process, which has no process group (the op is
SDPA, the backend compiles the graph unchanged); 2 and 4 use the ``ranks`` pools.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models

import cp_compile
from checks import (AttentionCount, assemble, explain_record, loss_and_grad_errors, make_inputs, rel,
                    ring_fwd_bwd, ring_mismatches, sdpa_fwd_bwd)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("cp-fuzz-ci", derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("cp-fuzz-long", derandomize=False, print_blob=True, **_COMMON)
_BASE = settings.get_profile("cp-fuzz-long" if PROFILE == "long" else "cp-fuzz-ci")
# examples per world size (1, 2, 4)
RING_EXAMPLES = {1: 40, 2: 200, 4: 160} if PROFILE == "long" else {1: 3, 2: 12, 4: 9}
MODEL_EXAMPLES = {1: 6, 2: 30, 4: 24} if PROFILE == "long" else {1: 1, 2: 3, 4: 2}

FP32_RTOL, BF16_FACTOR, BF16_SANITY = 1e-5, 2.0, 2e-2
LOAD_BALANCES = ("zigzag", "striped", "contiguous")


# --------------------------------------------------------------------------- the ring op


@st.composite
def ring_cases(draw, world: int) -> dict:
    """One ring-op configuration (keys as tests/test_ring_exact.py's configs, plus more)."""
    lb = draw(st.sampled_from(LOAD_BALANCES))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    unit = 2 * world if lb == "zigzag" else world  # what the layout needs S to divide by
    hkv = draw(st.integers(1, 3))
    # bf16: enough elements that the norm-wise error compares statistics, not single roundings
    min_tokens = 16 if dtype == "bfloat16" else 2
    s = unit * draw(st.integers(max(1, -(-min_tokens // unit)), max(2, 64 // unit)))
    return dict(
        world=world, lb=lb, dtype=dtype, s=s, hkv=hkv, h=hkv * draw(st.integers(1, 3)),
        b=draw(st.integers(1, 2)), d=draw(st.sampled_from([8, 16, 24, 40, 64])),
        causal=draw(st.booleans()), rotate=draw(st.sampled_from(["p2p", "allgather"])),
        kernel=draw(st.sampled_from(["auto", "reference"])),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))), seed=draw(st.integers(0, 2**31 - 1)),
    )


def _ring_case_rank_fn(cfg: dict):
    q, k, v, dout = make_inputs(cfg)
    return ring_fwd_bwd(q, k, v, dout, cfg, cfg["rotate"], getattr(torch, cfg["dtype"]), scale=cfg["scale"])


def _run_ring(ranks, cfg: dict) -> list:
    if cfg["world"] == 1:
        return [_ring_case_rank_fn(cfg)]
    return ranks.run(cfg["world"], _ring_case_rank_fn, cfg, timeout=120)


def _check_ring(ranks, cfg: dict) -> None:
    dtype = getattr(torch, cfg["dtype"])
    local = _run_ring(ranks, cfg)
    got = [assemble([res[j] for res in local], cfg["s"], cfg["lb"]) for j in range(4)]
    q, k, v, dout = (t.to(dtype).double() for t in make_inputs(cfg))
    ref64 = sdpa_fwd_bwd(q, k, v, dout, cfg["causal"], torch.float64, scale=cfg["scale"])
    single = sdpa_fwd_bwd(q, k, v, dout, cfg["causal"], dtype, scale=cfg["scale"])
    for name, a, want, s in zip(("out", "dq", "dk", "dv"), got, ref64, single):
        assert torch.isfinite(a).all(), (name, cfg)
        err = rel(a, want)
        if dtype == torch.float32:
            assert err <= FP32_RTOL, (name, err, cfg)
        else:
            single_err = rel(s, want)
            assert err <= BF16_FACTOR * single_err and err < BF16_SANITY, (name, err, single_err, cfg)


def _ring_test(world: int):
    @settings(_BASE, max_examples=RING_EXAMPLES[world])
    @given(cfg=ring_cases(world))
    def test(ranks, cfg):
        _check_ring(ranks, cfg)

    return test


test_fuzz_ring_op_world_1 = _ring_test(1)
test_fuzz_ring_op_world_2 = _ring_test(2)
test_fuzz_ring_op_world_4 = _ring_test(4)


# --------------------------------------------------------------------------- generated models


@st.composite
def model_cases(draw, world: int) -> dict:
    """A small model from examples/models.py with random dimensions and sequence length."""
    factory = draw(st.sampled_from(["llama_factory", "gpt2_factory", "encoder_factory"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    cfg = dict(dim=heads * head_dim, n_layers=draw(st.integers(1, 2)), n_heads=heads)
    if factory == "llama_factory":
        cfg.update(n_kv_heads=draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
                   gqa_mode=draw(st.sampled_from(["enable_gqa", "repeat_interleave", "expand"])),
                   rope_style=draw(st.sampled_from(["arange_index", "slice"])), ffn_hidden=2 * cfg["dim"])
    elif factory == "encoder_factory":
        cfg.update(pos_style=draw(st.sampled_from(["sinusoidal", "learned"])), ffn_hidden=2 * cfg["dim"])
    return dict(
        factory=factory, cfg=cfg, world=world,
        seq_len=draw(st.integers(3, 40)), batch=draw(st.integers(1, 2)), seed=draw(st.integers(0, 10_000)),
        options=dict(load_balance=draw(st.sampled_from(LOAD_BALANCES)),
                     rotate=draw(st.sampled_from(["p2p", "allgather"]))),
    )


def _model_case_fn(case: dict):
    """(loss rel err, max parameter-gradient rel err, #graphs rewritten, what of "every attention
    became the ring" fails) of ring_cp vs eager."""
    make = getattr(models, case["factory"])
    kw = dict(seq_len=case["seq_len"], batch=case["batch"], seed=case["seed"], **case["cfg"])
    ref_model, inputs = make(**kw)
    cp_model, _ = make(**kw)
    world = case["world"]  # 1: no process group; explain needs a CP group of 2 or more
    explained = explain_record(ref_model, inputs, world_size=world, **case["options"]) if world > 1 else None
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", **case["options"])
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    # explain says what the runtime did; a CP group of 1 compiles the graph unchanged, recording nothing
    assert backend.records == ([explained] if world > 1 else []), (backend.records, explained, case)
    rings = ring_mismatches(backend, count.calls) if world > 1 else []
    return (*loss_and_grad_errors(ref_model, ref, cp_model, out), len(backend.graphs), rings)


def _check_model(ranks, case: dict) -> None:
    if case["world"] == 1:
        per_rank = [_model_case_fn(case)]
    else:
        per_rank = ranks.run(case["world"], _model_case_fn, case, timeout=300)
    for rank, (loss_err, grad_err, n_graphs, rings) in enumerate(per_rank):
        assert loss_err <= FP32_RTOL and grad_err <= FP32_RTOL, (rank, loss_err, grad_err, case)
        assert n_graphs == (1 if case["world"] > 1 else 0), (rank, n_graphs, case)  # rewritten, as one graph
        assert not rings, (rank, rings, case)  # every attention became the ring


def _model_test(world: int):
    @settings(_BASE, max_examples=MODEL_EXAMPLES[world])
    @given(case=model_cases(world))
    def test(ranks, case):
        _check_model(ranks, case)

    return test


test_fuzz_models_world_1 = _model_test(1)
test_fuzz_models_world_2 = pytest.mark.slow(_model_test(2))
test_fuzz_models_world_4 = pytest.mark.slow(_model_test(4))
