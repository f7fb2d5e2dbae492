"""The Triton kernels inside the ring: in-kernel merge, tile skipping, and 2-rank exactness.

- Merging N visiting blocks in-kernel equals one attention over their concatenation,
  and its bf16 error does not grow with N (2, 4, 8), unlike a merge done outside the
  kernel on bf16 per-step outputs with a bf16 running result (how ring implementations
  that call a flash kernel per step and keep ``out`` in the input dtype behave).
- Tile skipping is real: for every (rank, visiting rank) step of a zig-zag causal
  ring, the tiles computed (a debug counter in the kernel) are exactly the tiles with
  at least one visible (query, key) pair, not all tiles.
- ``ring_attention(kernel="triton")`` on 2 gloo ranks, every layout, causal and not,
  fp32 and bf16: same tolerances as tests/test_ring_exact.py; and the padded form
  (``valid_len``) against the aten kernel on the same ranks.

Kernels run under ``TRITON_INTERPRET=1`` (conftest), so shapes are small.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch

from cp_compile.kernels.triton import Tiles, TritonKernel
from cp_compile.sequence import rank_positions
from cp_compile.ring.merge import merge_
from checks import (assemble, attention_inputs, example_through_ring_cp, large_logit_inputs, large_logits_rank_fn,
                    make_inputs, position_reference, rel, ring_fwd_bwd, sdpa_fwd_bwd, sdpa_reference)

T16 = Tiles(16, 16)
BLOCK = 32  # keys per visiting block in the merge test


# --------------------------------------------------------------------------- in-kernel merge


def merge_errors(n_blocks: int, seed: int) -> tuple[float, float]:
    """(in-kernel, out-of-kernel bf16) relative error of the merged output vs fp64."""
    kern = TritonKernel(T16)
    q, k, v, dout = attention_inputs(2, 4, 2, 32, BLOCK * n_blocks, 64, dtype=torch.bfloat16, seed=seed)
    k_pos = torch.arange(BLOCK * n_blocks, dtype=torch.int32)
    q_pos = torch.arange(32, dtype=torch.int32) + BLOCK * n_blocks  # every query sees every key
    want = position_reference(q, k, v, dout, q_pos, k_pos, causal=False, scale=0.125)[0]
    blocks = [slice(i * BLOCK, (i + 1) * BLOCK) for i in range(n_blocks)]
    state = kern.new_state(q)
    for sl in blocks:
        kern.forward_step(q, k[:, :, sl], v[:, :, sl], state, q_pos, k_pos[sl].contiguous(), causal=False, scale=0.125)
    fused, _ = kern.finalize(state, torch.bfloat16)
    out = lse = None  # out-of-kernel: per-step bf16 (out, lse), running out kept in bf16
    for sl in blocks:
        one = kern.new_state(q)
        kern.forward_step(q, k[:, :, sl], v[:, :, sl], one, q_pos, k_pos[sl].contiguous(), causal=False, scale=0.125)
        o, o_lse = kern.finalize(one, torch.bfloat16)
        if out is None:
            out, lse = o, o_lse
            continue
        acc = out.float()
        merge_(acc, lse, o, o_lse)
        out = acc.to(torch.bfloat16)
    return rel(fused, want), rel(out, want)


@pytest.mark.slow
def test_in_kernel_merge_error_does_not_grow_with_ring_size():
    errs = {n: merge_errors(n, seed=n) for n in (2, 4, 8)}
    report = ", ".join(f"N={n}: in-kernel {a:.3g}, out-of-kernel bf16 {b:.3g}" for n, (a, b) in errs.items())
    print(report)
    (in2, out2), (in8, out8) = errs[2], errs[8]
    assert in8 <= 1.5 * in2, report
    assert out8 > 1.25 * out2 and in8 < out8, report  # the alternative does grow


# --------------------------------------------------------------------------- tile skipping


def visible_tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, tile: int) -> tuple[int, int]:
    """(tiles with a visible causal pair, all tiles) for a 16 x 16 tiling."""
    vis = k_pos[None, :] <= q_pos[:, None]  # (Lq, Lk)
    lq, lk = vis.shape
    live = sum(
        bool(vis[i:i + tile, j:j + tile].any()) for i in range(0, lq, tile) for j in range(0, lk, tile)
    )
    return live, -(-lq // tile) * -(-lk // tile)


@pytest.mark.slow
def test_tile_skipping_counts_only_visible_tiles():
    n, s = 4, 256  # c = 64: 4 x 4 tiles per step
    kern = TritonKernel(T16)
    total_live = total_all = 0
    for rank, src in product(range(n), repeat=2):
        q_pos = rank_positions(s, n, rank, "zigzag").to(torch.int32)
        k_pos = rank_positions(s, n, src, "zigzag").to(torch.int32)
        q, k, v, dout = attention_inputs(1, 1, 1, s // n, s // n, 16, dtype=torch.float32, seed=rank * n + src)
        fwd_count, dq_count = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        state = kern.new_state(q)
        kern.forward_step(q, k, v, state, q_pos, k_pos, causal=True, scale=0.25, counter=fwd_count)
        out, lse = kern.finalize(state, q.dtype)
        grads = tuple(torch.zeros(t.shape) for t in (q, k, v))
        kern.backward_step(dout, q, k, v, lse, kern.delta(dout, out), grads, q_pos, k_pos, causal=True,
                           scale=0.25, counter=dq_count)
        live, every = visible_tiles(q_pos, k_pos, 16)
        assert fwd_count.item() == live == dq_count.item(), f"rank {rank} src {src}"
        total_live, total_all = total_live + live, total_all + every
    # Zig-zag: step 0 is causal (10 of 16 tiles), every other step is half a block (8 of 16).
    assert total_live == n * 10 + n * (n - 1) * 8 and total_all == n * n * 16


# --------------------------------------------------------------------------- 2 ranks


def _ring_cases() -> list[dict]:
    cases = []
    for i, (lb, causal) in enumerate(product(("zigzag", "striped", "contiguous"), (False, True))):
        h, hkv = ((4, 4), (4, 2), (4, 1))[i % 3]
        cases.append(dict(name=f"{lb}-{causal}", lb=lb, causal=causal, h=h, hkv=hkv, b=1 + i % 2,
                          d=(16, 24, 64)[i % 3], s=(64, 32, 48, 64, 32, 48)[i], kernel="triton", seed=500 + i))
    return cases


def _rank_ring(cases: list[dict], dtype_name: str) -> list[tuple]:
    dtype = getattr(torch, dtype_name)
    rotate = lambda i: "p2p" if i % 2 == 0 else "allgather"  # noqa: E731
    return [ring_fwd_bwd(*make_inputs(c), c, rotate(i), dtype) for i, c in enumerate(cases)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_ring_with_triton_kernel_matches_sdpa(ranks, dtype_name):
    cases, dtype = _ring_cases(), getattr(torch, dtype_name)
    per_rank = ranks.run(2, _rank_ring, cases, dtype_name, timeout=300)
    failures = []
    for i, cfg in enumerate(cases):
        ref64, single = sdpa_reference(cfg, dtype)
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], cfg["s"], cfg["lb"])
            err, serr = rel(got, ref64[j]), rel(single[j], ref64[j])
            bound = 1e-5 if dtype == torch.float32 else 2 * serr
            if not err <= bound:
                failures.append(f"{cfg['name']} {name}: {err:.3g} > {bound:.3g}")
    assert not failures, "\n".join(failures)


def _rank_padded(s: int, valid_len: int, causal: bool) -> dict:
    import cp_compile
    from cp_compile.group import resolve_group

    g = resolve_group(None)
    cfg = dict(b=1, h=4, hkv=2, s=s, d=24, seed=77)
    q, k, v, dout = make_inputs(cfg)
    dout[:, :, valid_len:] = 0  # padded rows feed nothing real (the rewrite masks them out of the loss)
    q, k, v, dout = (cp_compile.shard(t, 2, load_balance="zigzag").float() for t in (q, k, v, dout))
    res = {}
    for kernel in ("triton", "aten"):
        args = (q, k, v, causal, 0.2, g.name, "zigzag", "p2p", kernel, valid_len)
        out, lse = torch.ops.cp_compile.ring_attention_fwd(*args)
        grads = torch.ops.cp_compile.ring_attention_bwd(dout, q, k, v, out, lse, *args[3:])
        res[kernel] = (out, lse, *grads[:3])
    return res


@pytest.mark.parametrize("causal", [False, True])
def test_ring_padding_matches_aten(ranks, causal):
    """valid_len = 50 of 64: padding keys are never attended; real rows equal the aten path's.

    Padded query rows are not compared: they are outputs nobody reads (the aten path
    lets causal padded rows see padded keys, the Triton path masks every padded key)."""
    s, valid = 64, 50
    per_rank = ranks.run(2, _rank_padded, s, valid, causal, timeout=300)
    for r, res in enumerate(per_rank):
        real = rank_positions(s, 2, r, "zigzag") < valid
        for j, name in enumerate(("out", "lse", "dq")):
            t, a = res["triton"][j][:, :, real], res["aten"][j][:, :, real]
            assert rel(t, a) <= 1e-5, f"rank {r} {name}: {rel(t, a):.3g}"
        for j, name in ((3, "dk"), (4, "dv")):  # padded keys get no gradient
            t, a = res["triton"][j], res["aten"][j]
            assert rel(t[:, :, real], a[:, :, real]) <= 1e-5, f"rank {r} {name}"
            assert torch.equal(t[:, :, ~real], torch.zeros_like(t[:, :, ~real]))


# --------------------------------------------------------------------------- large logits

def test_large_logits_merge_without_lse_rounding(ranks):
    """fp32 logits ~1e3 on 2 ranks. The aten path merges per-step (out, lse) with lse
    rounded to fp32 (ulp 6e-5 at 1e3), which costs it 2-3e-5 on the output
    (test_ring_numerics.py). The Triton state keeps the running max and the sum apart
    across steps, so the output is as accurate as single-process fp32 SDPA's."""

    cases = [dict(kind=kind, lb=lb, causal=causal, kernel="triton", seed=300 + i)
             for i, (kind, lb, causal) in enumerate((("shifted", "zigzag", True), ("shifted", "striped", False),
                                                     ("saturated", "zigzag", True)))]
    per_rank = ranks.run(2, large_logits_rank_fn, cases, timeout=300)
    report, failures = [], []
    for i, case in enumerate(cases):
        q, k, v, dout, scale = large_logit_inputs(case["kind"], case["seed"])
        ref = sdpa_fwd_bwd(q, k, v, dout, case["causal"], torch.float64, scale=scale)
        single = sdpa_fwd_bwd(q, k, v, dout, case["causal"], torch.float32, scale=scale)
        for j, name in enumerate(("out", "dq", "dk", "dv")):
            got = assemble([res[i][j] for res in per_rank], q.shape[2], case["lb"])
            err, serr = rel(got, ref[j]), rel(single[j], ref[j])
            report.append(f"{case['kind']}-{case['lb']} {name}: triton {err:.3g}, single fp32 SDPA {serr:.3g}")
            if not (torch.isfinite(got).all() and err <= max(2 * serr, 1e-6)):
                failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- backend


def _llama_through_backend_with_triton() -> tuple:

    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = TritonKernel.forward_step, TritonKernel.backward_step

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    TritonKernel.forward_step, TritonKernel.backward_step = count("fwd", fwd), count("bwd", bwd)
    try:
        return (*example_through_ring_cp("llama_factory", {}, {"kernel": "triton"}), calls)
    finally:
        TritonKernel.forward_step, TritonKernel.backward_step = fwd, bwd


@pytest.mark.slow
def test_ring_cp_backend_with_triton_kernel_matches_single_device(ranks):
    """The example Llama compiled with backend ring_cp, kernel="triton" (aot_eager, 2 ranks):
    loss and every parameter gradient equal the single-process run (fp32 <= 1e-5)."""
    for rank, (loss_err, grad_err, fallbacks, summary, calls) in enumerate(
        ranks.run(2, _llama_through_backend_with_triton, timeout=300)
    ):
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (rank, loss_err, grad_err)
        assert fallbacks == 0 and summary["ring_attention_fwd"] == 2, (rank, summary)
        assert calls == {"fwd": 2 * 2, "bwd": 2 * 2}, calls  # 2 layers x 2 ring steps, each way


def test_auto_kernel_is_triton_on_cuda_and_aten_on_cpu():
    from cp_compile.kernels import kernel_names, resolve_kernel_name

    assert resolve_kernel_name("auto", torch.device("cuda")) == "triton"
    assert resolve_kernel_name("auto", torch.device("cpu")) == "aten"
    assert "triton" in kernel_names()
