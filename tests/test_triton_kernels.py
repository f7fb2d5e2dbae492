"""The Triton ring-step kernels under ``TRITON_INTERPRET=1`` (set in conftest) against fp64 math.

What is checked (issue 4; docs/design.md §1, docs/kernels.md):

- forward (out, lse) and backward (dq, dk, dv) of one step, for causal / non-causal,
  each layout's position patterns (ranks 1 and 2 of zig-zag, striped and contiguous
  at N = 4 against every visiting block), GQA / MQA, head dims 16, 24, 64, 80, 128,
  S_q != S_k, padding (``kv_limit``) and fully masked blocks: fp32 <= 1e-5 relative
  to fp64 math; rows that see no key give out = 0, lse = -inf, zero gradients, no NaN;
- bf16 and fp16: error vs fp64 within 2x the aten kernel's on the same inputs;
- several steps merged in-kernel equal one attention over the concatenated blocks, and
  the bf16 error does not grow with the number of steps (N = 2, 4, 8), while a merge
  of bf16-rounded per-step results outside the kernel does;
- tile skipping is real: the number of tiles computed equals the number of tiles with
  at least one visible (query, key) pair;
- float64 and too-large head dims are refused with errors naming the fix.

Error metric: norm-wise relative error ||a - b|| / ||b|| in float64.
"""

from __future__ import annotations

import pytest
import torch

from cp_compile.kernels import get_kernel
from cp_compile.kernels.triton import Tiles, TritonKernel, zero_grads
from cp_compile.sequence import rank_positions
from checks import attention_inputs, check_fp32, position_reference, real_compile, rel_or_abs

T16 = Tiles(16, 16)  # small tiles: several per block, partial last tiles


def run(kernel, q, k, v, dout, q_pos, k_pos, *, causal, scale, kv_limit=2**31 - 1, lse_for_bwd=None, out_for_bwd=None):
    """One forward step + finalize and one backward step; (out, lse, dq, dk, dv), fp32 grads."""
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    state = kernel.new_state(q)
    kernel.forward_step(q, k, v, state, q_pos, k_pos, causal=causal, scale=scale, kv_limit=kv_limit)
    out, lse = kernel.finalize(state, q.dtype)
    grads = zero_grads(q, k)
    o_b = out if out_for_bwd is None else out_for_bwd
    l_b = lse if lse_for_bwd is None else lse_for_bwd
    kernel.backward_step(dout, q, k, v, l_b, kernel.delta(dout, o_b), grads, q_pos, k_pos,
                         causal=causal, scale=scale, kv_limit=kv_limit)
    return (out, lse, *grads)


@pytest.mark.slow
@pytest.mark.parametrize("d", [16, 24, 64, 80, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_local_step_matches_fp64(d, causal):
    """Plain causal / non-causal attention over local positions, MHA and GQA, every head dim."""
    h, hkv = (4, 2) if d % 16 else (2, 2)
    q, k, v, dout = attention_inputs(1, h, hkv, 48, 48, d, dtype=torch.float32, seed=d)
    pos = torch.arange(48)
    want = position_reference(q, k, v, dout, pos, pos, causal=causal, scale=d**-0.5)
    got = run(TritonKernel(T16), q, k, v, dout, pos, pos, causal=causal, scale=d**-0.5)
    check_fp32(got, want, f"d={d} causal={causal}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_every_layout_step_matches_fp64(layout):
    """Ranks 1 and 2 of a 4-rank causal ring against every visiting block (lower, own and
    higher ranks: every mask kind of the layout), by global positions; MQA, B=2."""
    n, s, d = 4, 128, 24
    kern = TritonKernel(T16)
    for rank in (1, 2):
        for src in range(n):
            q_pos, k_pos = rank_positions(s, n, rank, layout), rank_positions(s, n, src, layout)
            q, k, v, dout = attention_inputs(2, 2, 1, s // n, s // n, d, dtype=torch.float32, seed=10 * rank + src)
            want = position_reference(q, k, v, dout, q_pos, k_pos, causal=True, scale=0.3)
            got = run(kern, q, k, v, dout, q_pos, k_pos, causal=True, scale=0.3)
            check_fp32(got, want, f"{layout} rank {rank} src {src}")


@pytest.mark.slow
def test_mixed_lengths_padding_and_masked_blocks():
    """S_q != S_k, padding keys cut by kv_limit, and a block whose keys are all invisible."""
    kern = TritonKernel(T16)
    q, k, v, dout = attention_inputs(1, 4, 2, 40, 72, 24, dtype=torch.float32, seed=3)
    q_pos, k_pos = torch.arange(100, 140), torch.arange(0, 144, 2)
    for causal, limit in ((False, 2**31 - 1), (False, 90), (True, 2**31 - 1), (True, 50)):
        want = position_reference(q, k, v, dout, q_pos, k_pos, causal=causal, scale=0.2, kv_limit=limit)
        got = run(kern, q, k, v, dout, q_pos, k_pos, causal=causal, scale=0.2, kv_limit=limit)
        check_fp32(got, want, f"causal={causal} kv_limit={limit}")
    # Every key after every query: the block is skipped, rows stay keyless.
    out, lse, dq, dk, dv = run(kern, q, k, v, dout, torch.arange(40), torch.arange(500, 572), causal=True,
                               scale=0.2, lse_for_bwd=torch.full((1, 4, 40), float("-inf")),
                               out_for_bwd=torch.zeros(1, 4, 40, 24))
    assert torch.equal(out, torch.zeros_like(out)) and lse.isneginf().all()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in (dq, dk, dv))


def test_rows_without_keys_mid_block():
    """Some rows see keys and some do not (causal, keys start mid-query-range): no NaN."""
    q, k, v, dout = attention_inputs(1, 2, 2, 32, 32, 16, dtype=torch.float32, seed=5)
    q_pos, k_pos = torch.arange(32), torch.arange(20, 52)
    want = position_reference(q, k, v, dout, q_pos, k_pos, causal=True, scale=0.25)
    got = run(TritonKernel(T16), q, k, v, dout, q_pos, k_pos, causal=True, scale=0.25,
              lse_for_bwd=want[1], out_for_bwd=want[0])
    check_fp32(got, want, "rows without keys")
    assert got[1][..., :20].isneginf().all() and torch.equal(got[0][..., :20, :], torch.zeros(1, 2, 20, 16))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_within_2x_of_aten(dtype, causal):
    q, k, v, dout = attention_inputs(2, 4, 2, 64, 64, 64, dtype=dtype, seed=7)
    pos = torch.arange(64)
    want = position_reference(q, k, v, dout, pos, pos, causal=causal, scale=0.125)
    aten, tri = get_kernel("aten", q.device, dtype), TritonKernel(T16)
    a_out, a_lse = aten.forward(q, k, v, causal=causal, scale=0.125)
    a_grads = aten.backward(dout, q, k, v, a_out, a_lse, causal=causal, scale=0.125)
    t_out, t_lse, *t_grads = run(tri, q, k, v, dout, pos, pos, causal=causal, scale=0.125)
    # Both backwards from their own forward's out/lse, as in training.
    for name, t, a, w in zip(("out", "dq", "dk", "dv"), (t_out, *t_grads), (a_out, *a_grads), (want[0], *want[2:])):
        te, ae = rel_or_abs(t.to(dtype), w), rel_or_abs(a, w)
        assert te <= 2 * ae, f"{dtype} {name}: triton {te:.3g} vs aten {ae:.3g}"
    assert rel_or_abs(t_lse, want[1]) <= 2 * max(rel_or_abs(a_lse, want[1]), 1e-6)


def test_dtypes_and_head_dims_refused_with_fix():
    kern = TritonKernel()
    assert not kern.supports(torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match="kernel 'triton'.*float64.*Fix"):
        get_kernel("triton", torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match="head dims up to 256.*Fix"):
        kern.new_state(torch.zeros(1, 1, 16, 320))
    with pytest.raises(ValueError, match="powers of two >= 16"):
        Tiles(8, 16)


def test_benchmark_flop_count_and_dry_run(capsys):
    """The micro-benchmark counts visible pairs exactly and its harness runs (interpreter)."""
    from cp_compile.kernels.triton import bench

    for rank, src in ((0, 0), (0, 3), (2, 1)):
        q_pos, k_pos = rank_positions(64, 4, rank, "zigzag"), rank_positions(64, 4, src, "zigzag")
        brute = int((k_pos[None, :] <= q_pos[:, None]).sum())
        assert bench.visible_pairs(q_pos, k_pos, True) == brute
    assert bench.step_flops(1, 2, 64, 100) == (4 * 2 * 64 * 100, 2.5 * 4 * 2 * 64 * 100)
    bench.main(["--seq-len", "64", "--world-size", "2", "--heads", "1", "--kv-heads", "1",
                "--head-dim", "16", "--reps", "1", "--cpu-scale", "1"])
    out = capsys.readouterr().out
    assert "interpreter dry run" in out and out.count("rank") >= 2


@pytest.mark.slow
def test_kernels_compile_for_real_gpus():
    """The real Triton compiler (ptxas included) accepts every kernel for sm_80 and sm_90:
    tile shapes, dtypes and control flow obey the GPU's rules, which the interpreter
    does not check. Runs in a subprocess without TRITON_INTERPRET."""
    records = real_compile("compile_all(90, 'bf16', head_dim=80, group=4) "
                           "+ compile_all(80, 'fp16', head_dim=64, group=1, causal=False)")
    assert sorted({r["kernel"] for r in records}) == ["_bwd_dkdv", "_bwd_dq", "_finalize", "_fwd_step"]
    assert len(records) == 8 and all(r["cubin_bytes"] > 0 for r in records)
    assert max(r["shared_bytes"] for r in records) <= 164 * 1024  # fits an A100's shared memory
