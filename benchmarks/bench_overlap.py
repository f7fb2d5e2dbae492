"""Benchmark 3: does the ring hide its transfers behind compute?

    .venv/bin/python benchmarks/bench_overlap.py                  # defaults (~1 min on 2 cores)
    .venv/bin/python benchmarks/bench_overlap.py --worlds 2,4 --sleep 0.2 --local-len 524288

Two measurements on real gloo ranks (127.0.0.1, one torch thread each):

1. The ring's own schedule (``cp_compile.ring.comm``: the double-buffered K/V
   rotation ``kv_blocks`` and, for the backward, the travelling dK/dV accumulator
   ``GradSink``) driven by a stand-in kernel of known duration T (it sleeps, leaving
   the CPU to gloo's transfer threads) with real K/V blocks of ``--local-len`` tokens.
   X = one blocking ring hop of a (K, V) pair, measured alone. Ideal schedules:

       forward : (N-1) * max(T, X) + T            (N-1 K/V hops, each under a step)
       backward: (N-1) * max(T, 2X) + T + X       (K/V and dK/dV hops in flight together;
                                                   the last dK/dV hop follows the last step)

   Reported: wall / ideal (target <= 1.10; without any overlap a compute-bound ring
   would take N*T + (N-1)*X forward). When T >= X this is wall / (N * max(compute,
   transfer) per step) up to the last step.

2. The same ring with the real CPU kernel: ``cp_compile.ring_attention`` forward +
   backward at ``--real-seq-len``, the aten kernel wrapped to time its own calls
   (C = kernel seconds per rank). Reported: wall / (C + hideable transfers done
   serially) and wall / ideal-overlap. On 2 cores shared by 2 ranks, gloo's copies
   need the same cores as the kernel, so this cannot reach the stand-in's ratio; the
   numbers say by how much.

Each figure is the median over ``--repeats``; per rank the worst rank is reported.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import common


def _hop(k, v, group) -> float:
    """Seconds of one blocking ring hop of (k, v): send to rank+1, receive from rank-1."""
    import torch
    import torch.distributed as dist

    bufs = [torch.empty_like(k), torch.empty_like(v)]
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    ops = [dist.P2POp(dist.isend, t, group_peer=nxt, group=group.pg) for t in (k, v)]
    ops += [dist.P2POp(dist.irecv, b, group_peer=prv, group=group.pg) for b in bufs]
    t0 = time.perf_counter()
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return time.perf_counter() - t0


def schedule_rank(rank: int, world: int, args) -> Dict[str, List[float]]:
    """One rank: walls of the forward and backward ring schedules with a sleeping consumer, and hops."""
    import torch
    import torch.distributed as dist

    from cp_compile.group import resolve_group
    from cp_compile.ring.comm import GradSink, kv_blocks

    group = resolve_group(None)
    k, v, dk, dv = (torch.randn(1, 1, args.local_len, 32) for _ in range(4))  # (B, H_kv, c, D) fp32

    def fwd() -> None:
        for _ in kv_blocks(k, v, group, "p2p"):
            time.sleep(args.sleep)

    def bwd() -> None:
        sink = GradSink(k, k.dtype, group, "p2p")
        for step, src, _k, _v in kv_blocks(k, v, group, "p2p"):
            time.sleep(args.sleep)
            sink.add(step, src, dk, dv)
        sink.finish()

    fwd(), bwd()  # warm-up: gloo connections
    res: Dict[str, List[float]] = {"hop": [], "fwd": [], "bwd": []}
    for _ in range(args.repeats):
        dist.barrier()
        res["hop"].append(_hop(k, v, group))
        res["fwd"].append(common.timed(fwd, dist.barrier))
        res["bwd"].append(common.timed(bwd, dist.barrier))
    return res


class TimedAten:
    """The aten block kernel, adding the seconds of its own calls to ``self.seconds``."""

    name = "timed_aten"

    def __init__(self) -> None:
        from cp_compile.kernels.aten import AtenKernel

        self.inner, self.seconds = AtenKernel(), 0.0

    def supports(self, device, dtype) -> bool:
        return self.inner.supports(device, dtype)

    def forward(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.inner.forward(*a, **kw)
        self.seconds += time.perf_counter() - t0
        return out

    def backward(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.inner.backward(*a, **kw)
        self.seconds += time.perf_counter() - t0
        return out


def real_rank(rank: int, world: int, args) -> Dict[str, List[float]]:
    """One rank: ring_attention fwd+bwd walls with the real kernel, its kernel seconds, and hops."""
    import torch
    import torch.distributed as dist

    import cp_compile
    from cp_compile.group import resolve_group
    from cp_compile.kernels import register_kernel

    kernel = TimedAten()
    register_kernel(kernel, replace=True)
    g = torch.Generator().manual_seed(0)
    s, h, hk, d = args.real_seq_len, 8, 2, 64
    q, k, v = (cp_compile.shard(torch.randn(1, n, s, d, generator=g), 2) for n in (h, hk, hk))  # (1, H*, S/N, D)

    def run() -> None:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = cp_compile.ring_attention(qq, kk, vv, causal=True, kernel="timed_aten")
        out.backward(torch.ones_like(out))

    run()
    res: Dict[str, List[float]] = {"hop": [], "wall": [], "kernel": []}
    for _ in range(args.repeats):
        res["hop"].append(_hop(k, v, resolve_group(None)))
        kernel.seconds = 0.0
        res["wall"].append(common.timed(run, dist.barrier))
        res["kernel"].append(kernel.seconds)
    return res


def summarise_schedule(world: int, per_rank: List[Dict[str, List[float]]], t: float) -> Dict[str, Any]:
    """Worst rank's median wall / ideal, forward and backward."""
    n, rows = world, []
    for m in per_rank:
        x = common.median(m["hop"])
        fwd, bwd = common.median(m["fwd"]), common.median(m["bwd"])
        ideal_f = (n - 1) * max(t, x) + t
        ideal_b = (n - 1) * max(t, 2 * x) + t + x
        rows.append({"hop_s": x, "fwd_s": fwd, "bwd_s": bwd, "fwd_ratio": fwd / ideal_f, "bwd_ratio": bwd / ideal_b,
                     "fwd_serial_ratio": (n * t + (n - 1) * x) / ideal_f})
    worst = max(rows, key=lambda r: max(r["fwd_ratio"], r["bwd_ratio"]))
    return {"world": world, "sleep_s": t, "ranks": rows, **{k: worst[k] for k in worst}}


def summarise_real(world: int, per_rank: List[Dict[str, List[float]]]) -> Dict[str, Any]:
    """Worst rank: wall vs serial (kernel + K/V and dK/dV hops one after another) and vs ideal overlap."""
    n, rows = world, []
    for m in per_rank:
        x, wall, c = common.median(m["hop"]), common.median(m["wall"]), common.median(m["kernel"])
        step = c / (2 * n)  # kernel seconds per ring step (N fwd + N bwd steps)
        ideal = (n - 1) * max(step, x) + step + (n - 1) * max(step, 2 * x) + step + x
        serial = c + 3 * (n - 1) * x + x
        rows.append({"hop_s": x, "wall_s": wall, "kernel_s": c, "ideal_s": ideal, "serial_s": serial,
                     "ratio_ideal": wall / ideal, "ratio_serial": wall / serial})
    worst = max(rows, key=lambda r: r["ratio_ideal"])
    return {"world": world, "ranks": rows, **worst}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--worlds", type=common.int_list, default=[2], help="ring sizes (4 puts 4 ranks on 2 cores)")
    p.add_argument("--sleep", type=float, default=0.2, help="stand-in kernel seconds per step T")
    p.add_argument("--local-len", type=int, default=131072, help="stand-in K/V tokens per rank (x32 fp32 each)")
    p.add_argument("--real-seq-len", type=int, default=8192, help="global S of the real-kernel ring")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    started = time.perf_counter()
    sched, real = [], []
    for world in args.worlds:
        common.log(f"stand-in kernel ({args.sleep} s/step), N={world}")
        sched.append(summarise_schedule(world, common.run_ranks(schedule_rank, world, args), args.sleep))
        s = sched[-1]
        common.log(f"  hop {s['hop_s']:.3f} s; wall/ideal fwd {s['fwd_ratio']:.3f}, bwd {s['bwd_ratio']:.3f}")
        common.log(f"real CPU kernel, S={args.real_seq_len}, N={world}")
        real.append(summarise_real(world, common.run_ranks(real_rank, world, args)))
        r = real[-1]
        common.log(f"  wall {r['wall_s']:.3f} s, kernel {r['kernel_s']:.3f} s, hop {r['hop_s']:.4f} s; "
                   f"wall/ideal {r['ratio_ideal']:.2f}, wall/serial {r['ratio_serial']:.2f}")
    common.write_result("overlap", {"schedule": sched, "real": real}, started, args)


if __name__ == "__main__":
    main()
