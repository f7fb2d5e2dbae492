"""Benchmark 2: causal load balance of the ring, zigzag vs striped vs contiguous.

    .venv/bin/python benchmarks/bench_balance.py                     # defaults (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_balance.py --local-len 4096 --worlds 2,4,8,16 --repeats 5

Simulation (2 cores cannot host 8 ranks fairly). In ONE process with one torch
thread, for each layout and ring size N, every (rank r, step t) block of the real ring
is run with the real aten CPU kernel on exactly the rectangles the ring's plan
computes (``cp_compile.ring.plan.step_segments``: rank r's queries against the K/V
block of rank (r - t) mod N, causal over global positions), forward (kernel + the
fp32 merge) and backward (kernel + the dQ accumulation) timed separately. Blocks with
the same rectangles (query rows, key rows, mask) do the same kernel work whatever
their data, so each distinct block is timed once per repeat and every (rank, step)
with it takes that time: a handful of distinct blocks per layout instead of N^2 (the
max over ranks then compares work, not samples of timing noise). Times are CPU time
of the computing thread (``time.thread_time``; one torch thread, so the kernels run
on it): time the process spends descheduled by other work on the shared cores does
not count, which wall time on a busy 2-core machine would. Each block's
time is the median over ``--repeats`` (the layouts alternate block by block, so load
from other processes hits them alike); the best-of-repeats makespan is reported too.
A synchronous ring waits for its slowest rank at every step, so the makespan is

    makespan = sum_t max_r fwd[r][t] + sum_t max_r bwd[r][t]

(transfers are left out: they are the same for every layout). The speed-up of a
layout is makespan(contiguous) / makespan(layout); theory for the causal forward is
(N - 1/2) / (N/2): 1.75x at N=4, 1.875x at N=8. The script also prints the plan's
exact pair-count makespan ratio (unmasked (query, key) pairs, no timing).

Real processes, for comparison: N = 2 and N = 4 gloo ranks on 127.0.0.1 (one thread
each) run ``cp_compile.ring_attention`` forward + backward with each layout; the
time is the slowest rank's, median over repeats (layouts alternate within each
repeat, with the shard included in the timed call). N = 4 puts 4 ranks on 2 cores, so
its times include oversubscription.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Dict, List

import common

LAYOUTS = ("zigzag", "striped", "contiguous")


def _inputs(seq_len: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq_len, dim, generator=g)  # (B, H, S, D)
    k = torch.randn(1, kv_heads, seq_len, dim, generator=g)  # (B, H_kv, S, D)
    v = torch.randn(1, kv_heads, seq_len, dim, generator=g)
    return q, k, v


def _time_block(kernel, qr, kb, vb, segs, scale: float) -> tuple:
    """(fwd seconds, bwd seconds) of one (rank, step) block: its segments, merge and accumulation."""
    import torch

    from cp_compile.ring.merge import merge_

    acc_out = torch.zeros(qr.shape)  # (B, H, c, D) fp32 accumulator
    acc_lse = torch.zeros(qr.shape[:-1])  # (B, H, c)
    dq = torch.zeros(qr.shape)
    t0 = time.thread_time()  # CPU time of this (the only computing) thread: other load doesn't count
    outs = []
    for s in segs:
        o, lse = kernel.forward(qr[:, :, s.q], kb[:, :, s.k], vb[:, :, s.k], causal=s.causal, scale=scale)
        merge_(acc_out[:, :, s.q], acc_lse[:, :, s.q], o, lse)
        outs.append((o, lse))
    t1 = time.thread_time()
    for s, (o, lse) in zip(segs, outs):
        dq_s, _, _ = kernel.backward(o, qr[:, :, s.q], kb[:, :, s.k], vb[:, :, s.k], o, lse,
                                     causal=s.causal, scale=scale)
        dq[:, :, s.q] += dq_s
    return t1 - t0, time.thread_time() - t1


def simulate(world: int, args) -> List[Dict[str, Any]]:
    """Per layout: per-(rank, step) fwd/bwd times (median of repeats) and the synchronous-ring makespan.

    The repeats are the outer loop and the layouts alternate innermost (block by
    block), so load from other processes on the machine falls on every layout alike.
    """
    from cp_compile.kernels import get_kernel
    from cp_compile.sequence import rank_positions
    from cp_compile.ring.plan import segment_pairs, source_rank, step_segments

    c = args.local_len
    s = c * world
    q, k, v = _inputs(s, args.heads, args.kv_heads, args.head_dim)
    kernel = get_kernel("aten", q.device, q.dtype)
    scale = 1.0 / math.sqrt(args.head_dim)
    times = {lay: [[([], []) for _ in range(world)] for _ in range(world)] for lay in LAYOUTS}  # [rank][step]
    pairs = {lay: [[0] * world for _ in range(world)] for lay in LAYOUTS}
    shards = {}
    for lay in LAYOUTS:
        pos = [rank_positions(s, world, r, lay) for r in range(world)]
        shards[lay] = [(q[:, :, p], k[:, :, p], v[:, :, p]) for p in pos]  # (B, H*, c, D) each
    for _ in range(args.repeats):
        timed: Dict[tuple, tuple] = {}  # block signature -> (fwd, bwd) seconds, this repeat
        for r in range(world):
            for t in range(world):
                for lay in LAYOUTS:
                    src = source_rank(r, t, world)
                    segs = step_segments(lay, True, world, r, src, c)
                    pairs[lay][r][t] = sum(segment_pairs(sg, c) for sg in segs)
                    sig = _signature(segs, c)
                    if sig not in timed:
                        sh = shards[lay]
                        timed[sig] = _time_block(kernel, sh[r][0], sh[src][1], sh[src][2], segs, scale)
                    times[lay][r][t][0].append(timed[sig][0])
                    times[lay][r][t][1].append(timed[sig][1])
    return [_summarise(lay, world, s, times[lay], pairs[lay]) for lay in LAYOUTS]


def _signature(segs, c: int) -> tuple:
    """What a block's kernel work depends on: each rectangle's query rows, key rows and mask."""
    return tuple((len(range(c)[sg.q]), len(range(c)[sg.k]), sg.causal) for sg in segs)


def _summarise(layout: str, world: int, seq_len: int, times, pairs) -> Dict[str, Any]:
    """Per block the median (and the best) of the repeats; the makespan sum_t max_r for the fwd
    and the bwd ring each; per-rank busy time."""
    out: Dict[str, Any] = {"layout": layout, "world": world, "seq_len": seq_len,
                           "pair_makespan": sum(max(pairs[r][t] for r in range(world)) for t in range(world))}
    for stat, fn in (("", common.median), ("best_", min)):
        fwd = [[fn(times[r][t][0]) for t in range(world)] for r in range(world)]
        bwd = [[fn(times[r][t][1]) for t in range(world)] for r in range(world)]
        out[stat + "makespan_s"] = sum(max(fwd[r][t] for r in range(world)) + max(bwd[r][t] for r in range(world))
                                       for t in range(world))
        out[stat + "rank_busy_s"] = [sum(fwd[r]) + sum(bwd[r]) for r in range(world)]
        if not stat:
            out.update(fwd_s=fwd, bwd_s=bwd)
    return out


def kernel_costs(args) -> Dict[str, float]:
    """Best-of-repeats fwd+bwd seconds of the three block shapes the causal ring uses, c = --local-len:
    causal c x c (step 0, and every striped step), unmasked c x c (contiguous), unmasked c x c/2
    (zigzag). On a kernel that skips masked work perfectly, causal ≈ half ≈ 0.5 x full."""
    from cp_compile.kernels import get_kernel
    from cp_compile.ring.plan import ALL, Segment

    c = args.local_len
    q, k, v = _inputs(c, args.heads, args.kv_heads, args.head_dim)
    kernel = get_kernel("aten", q.device, q.dtype)
    shapes = {"causal": (Segment(ALL, ALL, True),), "full": (Segment(ALL, ALL, False),),
              "half": (Segment(ALL, slice(0, c // 2), False),)}
    out: Dict[str, List[float]] = {n: [] for n in shapes}
    for _ in range(max(3, args.repeats)):
        for name, segs in shapes.items():
            out[name].append(sum(_time_block(kernel, q, k, v, segs, 1.0 / math.sqrt(args.head_dim))))
    med = {n: min(x) for n, x in out.items()}  # best of: the kernel's own cost, not the machine's load
    return {"causal_s": med["causal"], "full_s": med["full"], "half_s": med["half"],
            "causal_over_full": med["causal"] / med["full"], "half_over_full": med["half"] / med["full"]}


def real_rank(rank: int, world: int, args) -> Dict[str, List[float]]:
    """In one rank: fwd+bwd wall times of ring_attention per layout (layouts alternate each repeat)."""
    import torch
    import torch.distributed as dist

    import cp_compile

    full = _inputs(args.local_len * world, args.heads, args.kv_heads, args.head_dim)

    def run(layout: str) -> None:
        q, k, v = (cp_compile.shard(t, 2, load_balance=layout).requires_grad_() for t in full)
        out = cp_compile.ring_attention(q, k, v, causal=True, load_balance=layout)
        out.backward(torch.ones_like(out))

    times: Dict[str, List[float]] = {lay: [] for lay in LAYOUTS}
    for lay in LAYOUTS:
        run(lay)  # warm-up (gloo connections)
    for _ in range(args.repeats):
        for lay in LAYOUTS:
            times[lay].append(common.timed(lambda: run(lay), dist.barrier))
    return times


def run_real(args) -> List[Dict[str, Any]]:
    """Real N-rank runs: per layout, the median over repeats of the slowest rank's time."""
    rows = []
    for world in args.real_worlds:
        common.log(f"real ring: N={world}, layouts {', '.join(LAYOUTS)}")
        res = common.try_run_ranks(real_rank, world, args)
        for layout in LAYOUTS:
            if isinstance(res, dict):
                rows.append({"world": world, "layout": layout, "error": res["error"]})
                continue
            per_rep = [max(ts) for ts in zip(*(r[layout] for r in res))]
            rows.append({"world": world, "layout": layout, "seconds": common.median(per_rep)})
    for r in rows:
        base = next((x for x in rows if x["world"] == r["world"] and x["layout"] == "contiguous"), None)
        if base and "seconds" in base and "seconds" in r:
            r["speedup_vs_contiguous"] = base["seconds"] / r["seconds"]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--local-len", type=int, default=2048, help="tokens per rank c (S = c*N); even")
    p.add_argument("--worlds", type=common.int_list, default=[2, 4, 8], help="simulated ring sizes")
    p.add_argument("--real-worlds", type=common.int_list, default=[2, 4], help="real gloo ring sizes")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    started = time.perf_counter()
    import torch

    torch.set_num_threads(1)  # one rank = one core
    sim = []
    for world in args.worlds:
        common.log(f"simulated ring: N={world}, layouts {', '.join(LAYOUTS)}")
        sim.extend(simulate(world, args))
    costs = kernel_costs(args)
    common.log(f"block costs at c={args.local_len}: causal/full {costs['causal_over_full']:.2f}, "
               f"half/full {costs['half_over_full']:.2f} (ideal 0.5, 0.5)")
    for row in sim:
        base = next(x for x in sim if x["world"] == row["world"] and x["layout"] == "contiguous")
        row["speedup_vs_contiguous"] = base["makespan_s"] / row["makespan_s"]
        row["best_speedup_vs_contiguous"] = base["best_makespan_s"] / row["best_makespan_s"]
        row["pair_speedup_vs_contiguous"] = base["pair_makespan"] / row["pair_makespan"]
        n = row["world"]
        row["theory_fwd_speedup"] = (n - 0.5) / (n / 2) if row["layout"] != "contiguous" else 1.0
        # What the measured block costs predict (step 0 causal, then N-1 steps of the layout's shape).
        step = {"zigzag": costs["half_s"], "striped": costs["causal_s"], "contiguous": costs["full_s"]}
        row["cost_model_speedup"] = ((costs["causal_s"] + (n - 1) * costs["full_s"])
                                     / (costs["causal_s"] + (n - 1) * step[row["layout"]]))
        common.log(f"N={row['world']} {row['layout']:10s}: makespan {row['makespan_s']:.3f} s, "
                   f"x{row['speedup_vs_contiguous']:.2f} vs contiguous "
                   f"(pairs x{row['pair_speedup_vs_contiguous']:.2f})")
    real = run_real(args)
    for r in real:
        common.log(f"real N={r['world']} {r['layout']:10s}: {r.get('seconds', r.get('error'))}")
    common.write_result("balance", {"simulated": sim, "real": real, "block_costs": costs}, started, args)


if __name__ == "__main__":
    main()
