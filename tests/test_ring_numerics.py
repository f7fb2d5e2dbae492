"""Numerics and tracing of ``cp_compile.ring_attention`` (split from test_ring_exact.py).

- logits of magnitude ~1e3 stay finite and accurate;
- ``torch.compile(..., fullgraph=True)`` keeps the op whole (the custom ops appear in the
  captured graphs) and matches eager;
- a process that never initialises torch.distributed gets exactly SDPA.

Error metric everywhere: norm-wise relative error ||a - b|| / ||b|| in float64.
"""

from __future__ import annotations

import math
from itertools import product

import pytest
import torch
import torch.distributed as dist

import cp_compile
from checks import (QUANTITIES, ROTATES, assemble, large_logit_inputs, large_logits_rank_fn, make_inputs, rel,
                    ring_fwd_bwd, sdpa_fwd_bwd)


LARGE_LOGIT_CASES = [
    dict(kind=kind, lb=lb, causal=causal, kernel=kernel, seed=300 + i)
    for i, (kind, (lb, causal, kernel)) in enumerate(
        product(
            ("shifted", "saturated"),
            (("zigzag", True, "auto"), ("striped", True, "reference"), ("contiguous", False, "auto"),
             ("striped", False, "aten")),
        )
    )
]


def test_large_logits_finite_and_accurate(ranks):
    """fp32, 4 ranks, logits ~1e3 (computed exactly in fp32, see ``large_logit_inputs``).

    No NaN/Inf anywhere. ``shifted`` (well conditioned): out, dq, dk, dv <= 1e-4 relative.
    ``saturated`` (nearly one-hot): out, dv <= 1e-4; dq, dk <= 1e-3, because they are
    ill-conditioned there: dS = P (dP - rowsum(dO * O)) is ~0 on one-hot rows, so the true
    dq/dk are small while any error in O enters them through rowsum(dO * O).

    Why the ring is measurably worse than single-process fp32 SDPA here (measured, seeds
    below): the block kernels hand back (out, lse) with lse rounded to fp32 at magnitude
    ~1e3 (half an ulp: 3e-5 absolute), and the merge weights exp(lse_block - lse) carry that
    as a relative error. SDPA never rounds a logit-sized number before normalising. So
    shifted: ring 2-3e-5 on all four vs SDPA 1e-7 (out) / 2e-5 (grads); saturated: ring
    out 3e-6, dq/dk up to 1.7e-4 vs SDPA 2e-8 / 2e-5.
    """
    world = 4
    results = ranks.run(world, large_logits_rank_fn, LARGE_LOGIT_CASES, timeout=300)
    failures = []
    for i, case in enumerate(LARGE_LOGIT_CASES):
        q, k, v, dout, scale = large_logit_inputs(case["kind"], case["seed"])
        s = q.shape[2]
        ref = sdpa_fwd_bwd(q, k, v, dout, case["causal"], torch.float64, scale=scale)
        single = sdpa_fwd_bwd(q, k, v, dout, case["causal"], torch.float32, scale=scale)
        sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * sc
        assert 900 <= logits.abs().max().item() <= 5000, "inputs do not have logits ~1e3"
        logits32 = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float().repeat_interleave(2, 1)) * sc
        assert torch.equal(logits32.double(), logits), "the fp32 logits should be exact"
        full = [assemble([res[i][j] for res in results], s, case["lb"]) for j in range(4)]
        tols = dict(out=1e-4, dq=1e-4, dk=1e-4, dv=1e-4)
        if case["kind"] == "saturated":
            tols.update(dq=1e-3, dk=1e-3)
        for qname, got, want, sgl in zip(QUANTITIES, full, ref, single):
            if not torch.isfinite(got).all():
                failures.append(f"{case}: {qname} has NaN/Inf")
                continue
            err = rel(got, want)
            if err > tols[qname]:
                failures.append(
                    f"{case}: {qname} rel err {err:.3g} > {tols[qname]:g} "
                    f"(single-process fp32 SDPA: {rel(sgl, want):.3g})"
                )
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- torch.compile

COMPILE_CASES = [
    dict(lb="zigzag", causal=True, h=4, hkv=2, b=2, s=32, d=24, kernel="auto", rotate="p2p", seed=501),
    dict(lb="striped", causal=False, h=4, hkv=1, b=1, s=48, d=80, kernel="auto", rotate="allgather", seed=502),
]


def _compile_rank_fn(cases):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    out = []
    for case in cases:
        graphs = {"dynamo": [], "forward": [], "backward": []}

        def fw(gm, example_inputs, graphs=graphs):
            graphs["forward"].append(gm.code)
            return make_boxed_func(gm.forward)

        def bw(gm, example_inputs, graphs=graphs):
            graphs["backward"].append(gm.code)
            return make_boxed_func(gm.forward)

        aot = aot_autograd(fw_compiler=fw, bw_compiler=bw)

        def recording_backend(gm, example_inputs, graphs=graphs, aot=aot):
            graphs["dynamo"].append(gm.code)
            return aot(gm, example_inputs)

        def attn(q, k, v, case=case):
            return cp_compile.ring_attention(
                q, k, v, causal=case["causal"], load_balance=case["lb"], rotate=case["rotate"], kernel=case["kernel"]
            )

        q, k, v, dout = make_inputs(case)
        ql, kl, vl, dol = (cp_compile.shard(t, 2, load_balance=case["lb"]).float() for t in (q, k, v, dout))

        def run(fn):
            leaves = [t.clone().requires_grad_() for t in (ql, kl, vl)]
            o = fn(*leaves)
            o.backward(dol)
            return (o.detach(), *(t.grad for t in leaves))

        eager = run(attn)
        compiled = run(torch.compile(attn, backend="aot_eager", fullgraph=True))
        recorded = run(torch.compile(attn, backend=recording_backend, fullgraph=True))
        out.append(dict(eager=eager, compiled=compiled, recorded=recorded, graphs=graphs))
    return out


def test_torch_compile_fullgraph_matches_eager(ranks):
    results = ranks.run(2, _compile_rank_fn, COMPILE_CASES, timeout=300)
    for i, case in enumerate(COMPILE_CASES):
        for r, res in enumerate(results):
            res = res[i]
            for variant in ("compiled", "recorded"):
                for qname, a, b in zip(QUANTITIES, res[variant], res["eager"]):
                    err = rel(a, b)
                    assert err <= 1e-6, f"{case} rank {r}: {variant} {qname} differs from eager (rel {err:.3g})"
            g = res["graphs"]
            # one Dynamo graph (fullgraph=True would have raised on a break), holding the op whole
            assert len(g["dynamo"]) == 1, g["dynamo"]
            assert "cp_compile.ring_attention_fwd" in g["dynamo"][0], g["dynamo"][0]
            assert len(g["forward"]) == 1 and "cp_compile.ring_attention_fwd" in g["forward"][0], g["forward"]
            assert len(g["backward"]) == 1 and "cp_compile.ring_attention_bwd" in g["backward"][0], g["backward"]
            # no collective or kernel call leaked into the graph: only the opaque op
            for code in (g["dynamo"][0], g["forward"][0], g["backward"][0]):
                assert "_c10d" not in code and "flash_attention" not in code, code


# --------------------------------------------------------------------------- world size 1


WORLD1_CASES = [
    dict(lb="zigzag", causal=True, h=4, hkv=2, b=2, s=32, d=24, kernel="auto", seed=601),
    dict(lb="striped", causal=False, h=4, hkv=1, b=1, s=17, d=80, kernel="reference", seed=602),
    dict(lb="contiguous", causal=True, h=4, hkv=4, b=1, s=9, d=64, kernel="aten", seed=603),
    dict(lb="zigzag", causal=False, h=4, hkv=4, b=2, s=64, d=64, kernel="auto", seed=604),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", WORLD1_CASES, ids=lambda c: f"{c['lb']}-{c['causal']}-{c['h']}x{c['hkv']}")
@pytest.mark.parametrize("scale", [None, 0.3])
def test_world_size_one_without_process_group_is_sdpa(case, dtype, scale):
    assert not (dist.is_available() and dist.is_initialized()), "the pytest process must not init a group"
    q, k, v, dout = make_inputs(case)
    for rot in ROTATES:
        got = ring_fwd_bwd(q, k, v, dout, case, rot, dtype, scale=scale)
        want = sdpa_fwd_bwd(q, k, v, dout, case["causal"], dtype, scale=scale)
        for qname, a, b in zip(QUANTITIES, got, want):
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a, b) or rel(a, b) <= 1e-6, f"{case} {rot} {qname}: {rel(a, b):.3g}"
