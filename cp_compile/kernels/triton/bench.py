"""FLOP-counted micro-benchmark of the Triton ring-step kernels (CUDA; CPU only as a dry run).

    python -m cp_compile.kernels.triton.bench --seq-len 16384 --world-size 8 --dtype bf16

For a zig-zag causal ring of ``--world-size`` ranks over ``--seq-len`` tokens it times,
on rank 0's shapes, the three kinds of step the ring runs: the diagonal step (causal
over the local block), a step against a lower rank (all queries x first half of the
keys) and one against a higher rank (second half of the queries x all keys), forward
and backward.

FLOP count (the usual attention convention, counting only work that is needed):

    pairs   = number of (query, key) pairs with the key visible (k_pos <= q_pos when
              causal), from the global positions: masked pairs are not counted
    forward = 4 · B · H · D · pairs          (Q·Kᵀ and P·V: 2·D FLOPs each per pair)
    backward = 2.5 · forward                 (dV, dP, dS·K, dSᵀ·Q and the recomputed Q·Kᵀ)

The kernels actually execute more than that: whole tiles that straddle the causal
boundary, and the backward recomputes Q·Kᵀ and dO·Vᵀ in both of its kernels (7 dots
per pair instead of 5). TFLOP/s below are therefore useful TFLOP/s.

Without CUDA this runs the same shapes once (scaled down by ``--cpu-scale``) under
Triton's interpreter when TRITON_INTERPRET=1 is set, to check the harness; the
interpreter's times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Dict, List, Tuple

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def visible_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> int:
    """(query, key) pairs with the key visible; k_pos must be increasing when causal."""
    if not causal:
        return q_pos.numel() * k_pos.numel()
    return int(torch.searchsorted(k_pos.cpu(), q_pos.cpu(), right=True).sum())


def step_flops(b: int, h: int, d: int, pairs: int) -> Tuple[float, float]:
    """(forward, backward) useful FLOPs of one step (module docstring)."""
    fwd = 4.0 * b * h * d * pairs
    return fwd, 2.5 * fwd


def _time(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``fn`` (CUDA events on GPU, wall clock otherwise)."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, rep=max(reps, 25), return_mode="median") / 1e3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _zigzag_steps(seq_len: int, world: int) -> Dict[str, Tuple[slice, slice, int]]:
    """Rank 0's step kinds: name -> (query rows, key rows, visiting rank)."""
    c = seq_len // world
    return {
        "diagonal (causal)": (slice(None), slice(None), 0),
        "lower rank (all x first half)": (slice(None), slice(0, c // 2), world - 1),
        "higher rank (second half x all)": (slice(c // 2, None), slice(None), 1),
    }


def run(args: argparse.Namespace) -> List[dict]:
    from . import TritonKernel, zero_grads
    from ...sequence import rank_positions

    cuda = torch.cuda.is_available()
    device, seq = ("cuda", args.seq_len) if cuda else ("cpu", max(64 * args.world_size, args.seq_len // args.cpu_scale))
    dtype, kern = DTYPES[args.dtype], TritonKernel()
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda h, n: torch.randn(args.batch, h, n, args.head_dim, device=device, dtype=dtype, generator=g)  # noqa: E731
    rows = []
    for name, (qs, ks, src) in _zigzag_steps(seq, args.world_size).items():
        q_pos = rank_positions(seq, args.world_size, 0, "zigzag")[qs].to(device, torch.int32).contiguous()
        k_pos = rank_positions(seq, args.world_size, src, "zigzag")[ks].to(device, torch.int32).contiguous()
        q, do = mk(args.heads, q_pos.numel()), mk(args.heads, q_pos.numel())
        k, v = mk(args.kv_heads, k_pos.numel()), mk(args.kv_heads, k_pos.numel())
        scale = args.head_dim**-0.5

        def fwd():
            state = kern.new_state(q)
            kern.forward_step(q, k, v, state, q_pos, k_pos, causal=True, scale=scale)
            return kern.finalize(state, dtype)

        out, lse = fwd()
        dlt = kern.delta(do, out)
        bwd = lambda: kern.backward_step(do, q, k, v, lse, dlt, zero_grads(q, k), q_pos, k_pos,  # noqa: E731
                                         causal=True, scale=scale)
        pairs = visible_pairs(q_pos, k_pos, True)
        f_fl, b_fl = step_flops(args.batch, args.heads, args.head_dim, pairs)
        t_f, t_b = _time(fwd, args.reps), _time(bwd, args.reps)
        rows.append(dict(step=name, q=q_pos.numel(), k=k_pos.numel(), pairs=pairs,
                         fwd_ms=t_f * 1e3, bwd_ms=t_b * 1e3,
                         fwd_tflops=f_fl / t_f / 1e12, bwd_tflops=b_fl / t_b / 1e12))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384, help="global sequence length (default 16384)")
    p.add_argument("--world-size", type=int, default=8, help="ring size whose rank-0 steps are timed (default 8)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    p.add_argument("--cpu-scale", type=int, default=64,
                   help="without CUDA: divide --seq-len by this (interpreter dry run)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("No CUDA device. For a dry run of the harness on CPU: TRITON_INTERPRET=1 python -m "
                             "cp_compile.kernels.triton.bench --heads 2 --kv-heads 1 --head-dim 64 --reps 1")
        print("No CUDA: interpreter dry run at reduced length; times are not kernel performance.")
    rows = run(args)
    print(f"{'step':34} {'q':>6} {'k':>6} {'pairs':>12} {'fwd ms':>9} {'TFLOP/s':>8} {'bwd ms':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['step']:34} {r['q']:6d} {r['k']:6d} {r['pairs']:12d} {r['fwd_ms']:9.3f} {r['fwd_tflops']:8.3f} "
              f"{r['bwd_ms']:9.3f} {r['bwd_tflops']:8.3f}")


if __name__ == "__main__":
    main()
