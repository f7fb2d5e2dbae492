"""Exactness: ring-attention error vs an fp64 reference as the ring grows (N = 1, 2, 4, 8).

    .venv/bin/python benchmarks/bench_error.py                     # defaults (~30 s)
    .venv/bin/python benchmarks/bench_error.py --seq-len 8192 --worlds 1,2,4,8,16

Simulation of the ring in ONE process (so N = 8 needs no 8 processes): for each rank
r of a zig-zag ring of N, its queries attend every K/V block in ring order (block
(r - t) mod N at step t) on the rectangles of ``cp_compile.ring.plan.step_segments``,
with the real block kernel; partial results are merged in fp32 with the ring's own
``cp_compile.ring.merge.merge_``. The backward feeds each block the global out and
lse, accumulates dQ per rank and dK/dV per block in fp32, adding the ranks'
contributions in the order the travelling accumulator visits them (b, b+1, ...).
That is the arithmetic of the distributed op, in the same order; only the transport
is missing. N = 1 is one causal block = the single-device kernel (for aten on CPU
this is what ``F.scaled_dot_product_attention`` runs).

Error: relative Frobenius norm ||x - x_ref|| / ||x_ref|| of out, dq, dk, dv against
float64 autograd of plain softmax attention, inputs rounded to the tested dtype
first (so the reference sees the same numbers). Causal, H=8, H_kv=2, D=64.

A ``triton`` kernel is included when one is registered (``cp_compile.kernels.triton``)
and runs at a tiny size under TRITON_INTERPRET=1 within ``--triton-timeout`` seconds
(in a subprocess); otherwise it is skipped and the reason recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

import common


def _reference(q, k, v, dout):
    """fp64 causal attention (GQA by repeating K/V) and its gradients."""
    import torch

    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, H, S, D)
    s = q @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S) fine at benchmark sizes
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ ve
    out.backward(dout.double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def simulate_ring(kernel, q, k, v, dout, world: int) -> Dict[str, Any]:
    """The zig-zag ring's forward and backward arithmetic for ``world`` ranks, in one process."""
    import torch

    from cp_compile.sequence import rank_positions
    from cp_compile.ring.merge import empty_partial, merge_
    from cp_compile.ring.plan import source_rank, step_segments

    s = q.shape[2]
    c, scale = s // world, 1.0 / math.sqrt(q.shape[-1])
    pos = [rank_positions(s, world, r, "zigzag") for r in range(world)]
    qs, ks, vs, ds = ([t[:, :, p] for p in pos] for t in (q, k, v, dout))  # per rank (B, H*, c, D)
    outs, lses = [], []
    for r in range(world):
        acc_o, acc_l = empty_partial(qs[r])  # fp32 (B, H, c, D), (B, H, c)
        for t in range(world):
            src = source_rank(r, t, world)
            for sg in step_segments("zigzag", True, world, r, src, c):
                o, lse = kernel.forward(qs[r][:, :, sg.q], ks[src][:, :, sg.k], vs[src][:, :, sg.k],
                                      causal=sg.causal, scale=scale)
                merge_(acc_o[:, :, sg.q], acc_l[:, :, sg.q], o, lse)
        outs.append(acc_o.to(q.dtype))
        lses.append(acc_l)
    dq = [torch.zeros(x.shape) for x in qs]
    dk = [torch.zeros(x.shape) for x in ks]
    dv = [torch.zeros(x.shape) for x in vs]
    for t in range(world):  # the accumulator of block b is at rank b + t at step t
        for b in range(world):
            r = (b + t) % world
            for sg in step_segments("zigzag", True, world, r, b, c):
                gq, gk, gv = kernel.backward(ds[r][:, :, sg.q], qs[r][:, :, sg.q], ks[b][:, :, sg.k], vs[b][:, :, sg.k],
                                             outs[r][:, :, sg.q], lses[r][:, :, sg.q], causal=sg.causal, scale=scale)
                dq[r][:, :, sg.q] += gq
                dk[b][:, :, sg.k] += gk
                dv[b][:, :, sg.k] += gv
    order = torch.argsort(torch.cat(pos))
    full = lambda parts: torch.cat(parts, 2)[:, :, order]  # noqa: E731  back to global order
    return {"out": full(outs), "dq": full(dq), "dk": full(dk), "dv": full(dv)}


def errors(kernel_name: str, dtype_name: str, args) -> List[Dict[str, Any]]:
    """Relative errors per N for one kernel and dtype."""
    import torch

    from cp_compile.kernels import get_kernel

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    s, h, hk, d = args.seq_len, 8, 2, 64
    q, k, v, dout = (torch.randn(1, n, s, d, generator=g).to(dtype) for n in (h, hk, hk, h))
    ref = _reference(q, k, v, dout)
    kernel = get_kernel(kernel_name, q.device, dtype)
    rows = []
    for world in args.worlds:
        got = simulate_ring(kernel, q, k, v, dout, world)
        err = {n: ((got[n].double() - ref[n]).norm() / ref[n].norm()).item() for n in ref}
        rows.append({"kernel": kernel_name, "dtype": dtype_name, "world": world, "seq_len": s, **err})
        common.log(f"{kernel_name} {dtype_name} N={world}: " + ", ".join(f"{n} {e:.2e}" for n, e in err.items()))
    return rows


def triton_rows(args) -> Dict[str, Any]:
    """Run this script for the triton kernel in a subprocess under TRITON_INTERPRET=1, tiny size."""
    cmd = [sys.executable, os.path.abspath(__file__), "--only-triton", "--seq-len", "128", "--worlds",
           ",".join(map(str, args.worlds)), "--dtypes", "float32"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.triton_timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"slower than {args.triton_timeout:.0f} s at S=128 under TRITON_INTERPRET=1"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"not available: {last}"}
    return {"rows": json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-len", type=int, default=2048, help="global S (divisible by 2N)")
    p.add_argument("--worlds", type=common.int_list, default=[1, 2, 4, 8])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--triton", choices=("auto", "off"), default="auto", help="include a registered triton kernel")
    p.add_argument("--triton-timeout", type=float, default=180.0)
    p.add_argument("--only-triton", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.only_triton:  # subprocess mode: print the rows as JSON on the last line
        import cp_compile.kernels.triton  # noqa: F401  registers "triton" (raises if missing)

        rows = [r for dt in args.dtypes.split(",") for r in errors("triton", dt, args)]
        print(json.dumps(rows))
        return
    rows = [r for dt in args.dtypes.split(",") for r in errors("aten", dt, args)]
    triton = triton_rows(args) if args.triton == "auto" else {"skipped": "--triton off"}
    common.log(f"triton: {triton.get('skipped', 'included')}")
    rows += triton.get("rows", [])
    common.write_result("error", {"rows": rows, "triton": triton.get("skipped", "included")}, started, args)


if __name__ == "__main__":
    main()
