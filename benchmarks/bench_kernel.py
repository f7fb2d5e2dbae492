"""Benchmark 5: the local CPU block kernel's GFLOP/s against torch.matmul on the same machine.

    .venv/bin/python benchmarks/bench_kernel.py   # defaults (~1 min; bf16 is slow without AVX512-BF16)
    .venv/bin/python benchmarks/bench_kernel.py --lens 1024,2048,4096,8192 --threads 2 --repeats 7

The kernel is the one the ring calls per block (``cp_compile.kernels.get_kernel("aten")``:
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), unmasked,
B=1, H=8 (K/V heads = H), D=64, Lq = Lk = L. FLOP convention (multiply-add = 2):
forward 4*H*L^2*D (q k^T and P v), backward 10*H*L^2*D (recomputing q k^T, then
dV, dP, dQ, dK). The ceiling is torch.matmul in the same dtype and thread count:
a square 1024^3 product and the attention-shaped (H, L, D) @ (H, D, L) product.
Efficiency = kernel GFLOP/s / the better matmul GFLOP/s. Times: median of repeats
after a warm-up call, fewer repeats (at least one) where calls are slow: on a CPU
without AVX512-BF16 or AMX, bf16 matmul is emulated at under 1 GFLOP/s, and the
ceiling is then far below the kernel (efficiency above 100%).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Dict, List

import common


SQUARE = 1024  # the square matmul ceiling: SQUARE^3 (2.1 GFLOP, milliseconds in fp32)
BUDGET_S = 4.0  # timed repeats of one measurement stop once they have taken about this long


def _gflops(flops: float, fn, repeats: int) -> float:
    """Median GFLOP/s over up to ``repeats`` timed calls after a warm-up; fewer (at least one)
    when one call is slow (bf16 matmul without AVX512-BF16/AMX runs at well under 1 GFLOP/s)."""
    warm = common.timed(fn)
    n = max(1, min(repeats, int(BUDGET_S / max(warm, 1e-9))))
    return flops / common.median([common.timed(fn) for _ in range(n)]) / 1e9


def kernel_rows(dtype_name: str, args) -> List[Dict[str, Any]]:
    """Kernel fwd/bwd GFLOP/s and the matmul ceilings for one dtype, per length."""
    import torch

    from cp_compile.kernels import get_kernel

    dtype = getattr(torch, dtype_name)
    kernel = get_kernel("aten", torch.device("cpu"), dtype)
    h, d, rows = args.heads, args.head_dim, []
    a, b = torch.randn(SQUARE, SQUARE, dtype=dtype), torch.randn(SQUARE, SQUARE, dtype=dtype)
    square = _gflops(2 * SQUARE**3, lambda: torch.matmul(a, b), args.repeats)
    for length in args.lens:
        q, k, v = (torch.randn(1, h, length, d, dtype=dtype) for _ in range(3))  # (1, H, L, D)
        scale = 1.0 / math.sqrt(d)
        out, lse = kernel.forward(q, k, v, causal=False, scale=scale)
        fwd = _gflops(4 * h * length**2 * d, lambda: kernel.forward(q, k, v, causal=False, scale=scale), args.repeats)
        bwd = _gflops(10 * h * length**2 * d,
                      lambda: kernel.backward(out, q, k, v, out, lse, causal=False, scale=scale), args.repeats)
        kt = k[0].transpose(1, 2).contiguous()  # (H, D, L)
        shaped = _gflops(2 * h * length**2 * d, lambda: torch.matmul(q[0], kt), args.repeats)
        ceiling = max(square, shaped)
        rows.append({"dtype": dtype_name, "len": length, "fwd_gflops": fwd, "bwd_gflops": bwd,
                     "matmul_square_gflops": square, "matmul_attn_shape_gflops": shaped,
                     "fwd_efficiency": fwd / ceiling, "bwd_efficiency": bwd / ceiling})
        common.log(f"{dtype_name} L={length}: kernel fwd {fwd:.1f} / bwd {bwd:.1f} GFLOP/s; matmul square "
                   f"{square:.1f}, attention-shaped {shaped:.1f} GFLOP/s")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--lens", type=common.int_list, default=[1024, 2048], help="block lengths L (default 1024,2048)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = one rank per core)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    started = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    rows = [r for dt in args.dtypes.split(",") for r in kernel_rows(dt, args)]
    common.write_result("kernel", {"rows": rows}, started, args)


if __name__ == "__main__":
    main()
