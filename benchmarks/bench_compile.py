"""Benchmark 7: compile time of ``ring_cp`` vs plain ``inductor``, cold and warm cache.

    .venv/bin/python benchmarks/bench_compile.py                     # defaults (~4 min on 2 cores)
    .venv/bin/python benchmarks/bench_compile.py --layers 8 --repeats 3

The example Llama (dim 256, ``--layers`` layers, S = ``--seq-len``), one training
step (forward + backward), compiled two ways:

* ``inductor``: 1 process x 1 thread, ``torch.compile(model, backend="inductor")``;
* ``ring_cp``: 2 ranks x 1 thread (gloo), ``torch.compile(model, backend=RingCP(inner="inductor"))``
  (each rank compiles on its own core, like the single process).

Compile time = wall of the first step minus the median of 2 later steps (the first
step also runs once). ``cold``: a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` under
``.cache/benchmarks/compile-*`` (gitignored); ``warm``: a new process on the cache the
cold run filled (Inductor's FX-graph and AOTAutograd caches). One Inductor compile
worker (``TORCHINDUCTOR_COMPILE_THREADS=1``) everywhere. Also reported: the CPU
seconds the process and its children (the C++ compiler) spent in the first step
(user + system, less sensitive to other load on the machine than wall time). ring_cp's figure is its slowest rank. Each
figure is the median over ``--repeats`` (each repeat with new cache dirs; the warm
figure over ``--warm-repeats`` launches per repeat: a warm compile takes seconds, so
one launch is at the mercy of whatever else the 2 cores are doing). And whether each
rank's compile hit, missed or bypassed the AOTAutograd cache (``torch._dynamo.utils.counters``).
Target: ring_cp / inductor <= 1.3 (cold and warm).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import time
import uuid
from typing import Any, Dict, List

import common

CFG = dict(vocab_size=1024, dim=256, n_heads=4, n_kv_heads=2, ffn_hidden=512)


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (Inductor runs the C++ compiler as one)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def rank_main(rank: int, world: int, args) -> Dict[str, float]:
    """First-step wall and CPU seconds, and the steady step time."""
    import torch
    import torch.distributed as dist

    from torch._dynamo.utils import counters

    import cp_compile
    import models

    model, (ids, labels) = models.llama_factory(seq_len=args.seq_len, batch=1, seed=0, max_seq_len=args.seq_len,
                                                n_layers=args.layers, **CFG)
    backend = cp_compile.RingCP(inner="inductor") if world > 1 else "inductor"
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    sync = dist.barrier if world > 1 else (lambda: None)

    def step() -> None:
        compiled(ids, labels).backward()
        model.zero_grad(set_to_none=True)

    sync()
    c0, t0 = _cpu_s(), time.perf_counter()
    step()
    first, first_cpu = time.perf_counter() - t0, _cpu_s() - c0
    aot = counters["aot_autograd"]  # did the first step's compile hit AOTAutograd's cache?
    steady = common.median([common.timed(step, sync) for _ in range(2)])
    return {"first_s": first, "first_cpu_s": first_cpu, "steady_s": steady,
            **{k: aot[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass")}}


def one_run(backend: str, cache: str, args) -> Dict[str, float]:
    """One launch on ``cache``: the slowest rank's compile wall and CPU seconds; AOTAutograd
    cache hits, misses and bypasses summed over the ranks."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read by the spawned processes at import
    world = 2 if backend == "ring_cp" else 1
    res = common.run_ranks(rank_main, world, args)
    return {"compile_s": max(r["first_s"] - r["steady_s"] for r in res),
            "compile_cpu_s": max(r["first_cpu_s"] for r in res), "steady_s": max(r["steady_s"] for r in res),
            **{f"aot_cache_{k}": sum(r[k] for r in res) for k in ("hit", "miss", "bypass")}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="cold runs, each on new cache dirs (default 1)")
    p.add_argument("--warm-repeats", type=int, default=2,
                   help="warm launches after each cold one, on its cache (default 2; a few seconds each)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    raw: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    for rep in range(args.repeats):
        for backend in ("inductor", "ring_cp"):
            cache = os.path.join(common.CACHE, f"compile-{backend}-{uuid.uuid4().hex[:8]}")
            os.makedirs(cache)
            for state in ("cold",) + ("warm",) * args.warm_repeats:
                common.log(f"[{rep + 1}/{args.repeats}] {backend}, {state} cache")
                r = one_run(backend, cache, args)
                raw.setdefault(backend, {}).setdefault(state, []).append(r)
                common.log(f"  compile {r['compile_s']:.1f} s wall, {r['compile_cpu_s']:.1f} s CPU")
            shutil.rmtree(cache, ignore_errors=True)
    rows: List[Dict[str, Any]] = []
    for state in ("cold", "warm"):
        med = {b: {k: common.median([r[k] for r in raw[b][state]]) for k in raw[b][state][0]} for b in raw}
        rows.append({"cache": state, **{f"{b}_{k}": v for b in med for k, v in med[b].items()},
                     "ratio_wall": med["ring_cp"]["compile_s"] / med["inductor"]["compile_s"],
                     "ratio_cpu": med["ring_cp"]["compile_cpu_s"] / med["inductor"]["compile_cpu_s"]})
        common.log(f"{state}: ring_cp / inductor = {rows[-1]['ratio_wall']:.2f} wall, {rows[-1]['ratio_cpu']:.2f} CPU")
    common.write_result("compile", {"rows": rows, "raw": raw}, started, args)


if __name__ == "__main__":
    main()
