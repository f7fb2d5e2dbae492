"""Exactness of ``cp_compile.ring_attention`` against single-process SDPA on the full sequence.

What is checked (docs/design.md §1, §3):

- out, dq, dk, dv of the ring (gloo groups of 1, 2 and 4 ranks), reassembled from
  every rank's shard with ``rank_positions``, against ``F.scaled_dot_product_attention``
  on the full sequence in float64 (``enable_gqa=True`` for GQA/MQA):
  fp32 <= 1e-5 relative; bf16 <= 2x the error of single-process bf16 SDPA on the same
  inputs (per quantity) and < 2e-2;
- ``rotate="p2p"`` and ``rotate="allgather"`` give bitwise-identical results;
- two identical runs give bitwise-identical results.

Large logits, torch.compile and the no-process-group case: test_ring_numerics.py.

The matrix is a covering set, not the full product: per world size and dtype, one config
per (layout, causal) pair, each run with both rotates; heads (MHA 4/4, GQA 4/2, MQA 4/1),
batch (1, 2), head dim (24, 64, 80), sequence length and kernel ("auto", "aten",
"reference") cycle over the configs so that every value of every axis appears. Each
(world size, dtype) is one ``ranks.run`` call; the results are cached for the tests
that look at them from different angles.

Error metric everywhere: norm-wise relative error ||a - b|| / ||b|| in float64.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch
import torch.nn.functional as F

import cp_compile
from checks import QUANTITIES, ROTATES, assemble, make_inputs, rel, ring_fwd_bwd, sdpa_reference

LOAD_BALANCES = ("zigzag", "striped", "contiguous")
HEADS = ((4, 4), (4, 2), (4, 1))  # (H, H_kv): MHA, GQA, MQA
HEAD_DIMS = (24, 64, 80)
SEQ_LENS = (32, 48, 64, 40, 96, 128)  # all multiples of 8 = 2N for N = 4
WORLD_SIZES = (1, 2, 4)
DTYPES = ("float32", "bfloat16")

FP32_RTOL = 1e-5
BF16_FACTOR = 2.0  # ring bf16 error <= 2x single-process bf16 SDPA error
BF16_SANITY = 2e-2


# --------------------------------------------------------------------------- inputs


def matrix(world_size: int, dtype_name: str) -> list[dict]:
    """The covering set of configs for one (world size, dtype); see the module docstring."""
    cfgs = []
    for i, (lb, causal) in enumerate(product(LOAD_BALANCES, (False, True))):
        h, hkv = HEADS[i % 3]
        if dtype_name == "float32":
            kernel = {1: "reference", 4: "reference", 5: "aten"}.get(i, "auto")
        else:
            kernel = "reference" if i == 3 else "auto"
        cfgs.append(
            dict(
                name=f"{lb}-{'causal' if causal else 'full'}-{i}",
                lb=lb, causal=causal, h=h, hkv=hkv,
                b=1 + i % 2,
                d=HEAD_DIMS[(i + world_size) % 3],
                s=SEQ_LENS[i],
                kernel=kernel,
                seed=10_000 * world_size + 100 * i + DTYPES.index(dtype_name),
            )
        )
    if dtype_name == "float32":
        # Edge lengths: the shortest sequence each layout can split (zigzag: one token per
        # chunk, c = 2; striped / contiguous: one token per rank, c = 1). At least 2 tokens:
        # with S = 1 the true dq and dk are exactly 0 and a relative error means nothing.
        for j, (lb, causal) in enumerate(product(LOAD_BALANCES, (False, True))):
            s = 2 * world_size if lb == "zigzag" else max(world_size, 2)
            cfgs.append(
                dict(
                    name=f"edge-{lb}-{'causal' if causal else 'full'}",
                    lb=lb, causal=causal, h=4, hkv=2, b=1, d=64, s=s, kernel="auto",
                    seed=20_000 * world_size + j,
                )
            )
    return cfgs


# --------------------------------------------------------------------------- rank side


def _matrix_rank_fn(cfgs: list[dict], dtype_name: str) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    results = []
    for cfg in cfgs:
        q, k, v, dout = make_inputs(cfg)
        res = {}
        for rot in ROTATES:
            res[rot] = ring_fwd_bwd(q, k, v, dout, cfg, rot, dtype)
            res[rot + "_again"] = ring_fwd_bwd(q, k, v, dout, cfg, rot, dtype)
        results.append(res)
    return results


# --------------------------------------------------------------------------- parent side

_CACHE: dict = {}


def matrix_results(ranks, world_size: int, dtype_name: str):
    """(configs, per-rank results) for one (world size, dtype), run once per session."""
    key = (world_size, dtype_name)
    if key not in _CACHE:
        cfgs = matrix(world_size, dtype_name)
        try:
            _CACHE[key] = (cfgs, ranks.run(world_size, _matrix_rank_fn, cfgs, dtype_name, timeout=300))
        except Exception as e:  # do not re-run a failing matrix for every test that reads it
            _CACHE[key] = e
    if isinstance(_CACHE[key], Exception):
        raise _CACHE[key]
    return _CACHE[key]


def describe(cfg: dict, world_size: int, rotate: str | None = None) -> str:
    keys = ("lb", "causal", "b", "h", "hkv", "s", "d", "kernel")
    return f"N={world_size} " + " ".join(f"{k}={cfg[k]}" for k in keys) + (f" rotate={rotate}" if rotate else "")


# --------------------------------------------------------------------------- tests


def test_matrix_covers_every_axis():
    """The covering set: every axis value appears; every (layout, causal, world) runs both rotates."""
    seen = {k: set() for k in ("lb", "causal", "heads", "b", "d", "kernel", "dtype", "world")}
    pairs = set()
    for n, dt in product(WORLD_SIZES, DTYPES):
        for cfg in matrix(n, dt):
            assert cfg["s"] % (2 * n if cfg["lb"] == "zigzag" else n) == 0
            for key, val in (("lb", cfg["lb"]), ("causal", cfg["causal"]), ("heads", (cfg["h"], cfg["hkv"])),
                             ("b", cfg["b"]), ("d", cfg["d"]), ("kernel", cfg["kernel"]), ("dtype", dt), ("world", n)):
                seen[key].add(val)
            for rot in ROTATES:  # every config runs with both rotates (_matrix_rank_fn)
                pairs.add((cfg["lb"], cfg["causal"], n, rot))
    assert seen["lb"] == set(LOAD_BALANCES)
    assert seen["causal"] == {False, True}
    assert seen["heads"] == set(HEADS)
    assert seen["b"] == {1, 2}
    assert seen["d"] >= {24, 64, 80}
    assert seen["kernel"] == {"auto", "aten", "reference"}
    assert pairs == set(product(LOAD_BALANCES, (False, True), WORLD_SIZES, ROTATES))


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_matches_full_sequence_sdpa(ranks, world_size, dtype_name):
    cfgs, results = matrix_results(ranks, world_size, dtype_name)
    dtype = getattr(torch, dtype_name)
    failures, report = [], []
    for i, cfg in enumerate(cfgs):
        ref64, ref_single = sdpa_reference(cfg, dtype)
        single_err = [rel(a, b) for a, b in zip(ref_single, ref64)]
        c = cfg["s"] // world_size
        for rot in ROTATES:
            local = [res[i][rot] for res in results]
            for r, (o, dq, dk, dv) in enumerate(local):  # dtypes and shapes of the local shards
                assert o.dtype == dq.dtype == dk.dtype == dv.dtype == dtype, describe(cfg, world_size, rot)
                assert o.shape == dq.shape == (cfg["b"], cfg["h"], c, cfg["d"]), describe(cfg, world_size, rot)
                assert dk.shape == dv.shape == (cfg["b"], cfg["hkv"], c, cfg["d"]), describe(cfg, world_size, rot)
            full = [assemble([x[j] for x in local], cfg["s"], cfg["lb"]) for j in range(4)]
            for qname, got, want, serr in zip(QUANTITIES, full, ref64, single_err):
                err = rel(got, want)
                if not torch.isfinite(got).all():
                    failures.append(f"{describe(cfg, world_size, rot)}: {qname} has NaN/Inf")
                    continue
                if dtype == torch.float32:
                    ok = err <= FP32_RTOL
                    bound = f"<= {FP32_RTOL:g}"
                else:
                    ok = err <= BF16_FACTOR * serr and err < BF16_SANITY
                    bound = f"<= 2 x single-process bf16 SDPA ({serr:.3g}) and < {BF16_SANITY:g}"
                report.append(f"{cfg['name']} {rot} {qname}: {err:.3g} (single {serr:.3g})")
                if not ok:
                    failures.append(f"{describe(cfg, world_size, rot)}: {qname} rel err {err:.3g}, want {bound}")
    assert not failures, "\n".join(failures)


def _rotate_equal(ranks, world_size, dtype_name, quantities):
    cfgs, results = matrix_results(ranks, world_size, dtype_name)
    bad = []
    for i, cfg in enumerate(cfgs):
        for r, res in enumerate(results):
            for j, qname in enumerate(QUANTITIES):
                if qname not in quantities:
                    continue
                a, b = res[i]["p2p"][j], res[i]["allgather"][j]
                if not torch.equal(a, b):
                    diff = (a.double() - b.double()).abs().max().item()
                    bad.append(f"{describe(cfg, world_size)} rank {r}: {qname} p2p != allgather "
                               f"(max |diff| {diff:.3g})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rotate_p2p_allgather_bitwise_identical_out_dq(ranks, world_size, dtype_name):
    """Both rotates visit the K/V blocks in the same order: out and dq (merged locally) match bitwise."""
    _rotate_equal(ranks, world_size, dtype_name, ("out", "dq"))


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rotate_p2p_allgather_bitwise_identical_dk_dv(ranks, world_size, dtype_name):
    """dK/dV travel differently (ring of accumulators vs one all-to-all): still the same bits,
    because the all-to-all path adds the contributions in the ring's order."""
    _rotate_equal(ranks, world_size, dtype_name, ("dk", "dv"))


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_deterministic(ranks, world_size, dtype_name):
    cfgs, results = matrix_results(ranks, world_size, dtype_name)
    bad = []
    for i, cfg in enumerate(cfgs):
        for r, res in enumerate(results):
            for rot in ROTATES:
                for j, qname in enumerate(QUANTITIES):
                    if not torch.equal(res[i][rot][j], res[i][rot + "_again"][j]):
                        bad.append(f"{describe(cfg, world_size, rot)} rank {r}: {qname} differs between runs")
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- large logits


# --------------------------------------------------------------------------- memory layout


def _strided_rank_fn() -> dict:
    """q, k, v whose head dim is not innermost (SqueezeBERT's (B, C, S) activations viewed as heads):
    the CPU flash kernel reads them as if row-major, so the ring op must make them so."""
    B, H, D, S = 2, 4, 16, 32
    g = torch.Generator().manual_seed(0)
    x, dout = torch.randn(B, H * D, S, generator=g), torch.randn(B, H, S, D, generator=g)
    ref_x = x.double().requires_grad_()
    heads = lambda t: t.view(B, H, D, -1).permute(0, 1, 3, 2)  # noqa: E731  (B, H, S, D), stride(-1) != 1
    ref = F.scaled_dot_product_attention(heads(ref_x), heads(ref_x), heads(ref_x), is_causal=True)
    ref.backward(dout.double())
    local = cp_compile.shard(x, 2).requires_grad_()
    q = heads(local)
    assert q.stride(-1) != 1
    out = cp_compile.ring_attention(q, q.transpose(-2, -1).transpose(-2, -1), q, causal=True)
    out.backward(cp_compile.shard(dout, 2))
    return {"out": rel(out, cp_compile.shard(ref.detach(), 2)),
            "dx": rel(local.grad, cp_compile.shard(ref_x.grad, 2))}


def test_head_dim_not_innermost_is_exact(ranks):
    for rank, errs in enumerate(ranks.run(2, _strided_rank_fn)):
        assert max(errs.values()) <= FP32_RTOL, (rank, errs)


def _issued(rotate: str) -> dict:
    """On a rank: the collectives the ring issues for one forward + backward with ``rotate``, counted
    at the torch.distributed calls made from cp_compile.ring.comm (not the options' agreement check)."""
    import sys
    from unittest import mock

    import cp_compile.ring.comm as comm

    calls: dict = {}

    def counting(name):
        real = getattr(comm.dist, name)

        def call(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename == comm.__file__:  # the K/V and dK/dV transfers only
                calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        return call

    cfg = {"b": 1, "h": 2, "hkv": 2, "s": 16, "d": 16, "seed": 0, "lb": "zigzag", "causal": True, "kernel": "aten"}
    names = ("batch_isend_irecv", "all_gather_single", "all_to_all_single")
    with mock.patch.multiple(comm.dist, **{n: counting(n) for n in names}):
        ring_fwd_bwd(*make_inputs(cfg), cfg, rotate, torch.float32)
    return calls


def test_each_rotate_issues_its_own_collectives(ranks):
    """``rotate`` is observed, not only its numbers. p2p posts N - 1 K/V hops forward; backward, the
    N - 1 K/V hops again and one dK/dV hop after each of the N steps (the accumulators travel home):
    3N - 2 batches, no all-gather. allgather posts one all-gather of the K/V blocks forward and one
    backward, and one all-to-all of the dK/dV blocks, no p2p hop."""
    n = 4
    for r in ranks.run(n, _issued, "p2p", timeout=120):
        assert r.get("all_gather_single", 0) == 0 and r.get("all_to_all_single", 0) == 0, r
        assert r["batch_isend_irecv"] == 3 * n - 2, r
    for r in ranks.run(n, _issued, "allgather", timeout=120):
        assert r.get("batch_isend_irecv", 0) == 0, r
        assert r["all_gather_single"] == 2 and r["all_to_all_single"] == 1, r
