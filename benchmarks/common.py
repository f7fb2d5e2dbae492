"""Helpers shared by the benchmark scripts: process launch, peak memory, timing, results.

Every benchmark script writes one JSON record to ``benchmarks/results/<name>.json``
(:func:`write_result`) holding its measurements, the exact command, the machine
and its own wall time; ``run_all.py`` renders the records into ``RESULTS.md`` and
the plots. Nothing here is a number: every figure comes from the run that wrote it.

Peak memory on CPU (Linux): the process's resident high-water mark (VmHWM from
/proc/self/status). :func:`measure_peak` first resets VmHWM to the current resident
size (``/proc/self/clear_refs``), so it reports both the absolute process peak
(includes the ~hundreds of MiB of the Python + torch baseline) and the peak *above*
the resident size just before the measured call (the activations, gradients and
temporaries of that call). ``MALLOC_MMAP_THRESHOLD_`` is set for spawned processes
so freed large blocks go back to the OS and the high-water mark follows live tensors.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CACHE = os.path.join(ROOT, ".cache", "benchmarks")  # gitignored scratch (Inductor caches)
MMAP_THRESHOLD = "65536"

# This checkout's package and examples/models.py come first (a fresh clone needs no install
# of its own; spawned ranks inherit sys.path).
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


# ---------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only). Fix: run the benchmarks on Linux.")


def rss_mib() -> float:
    """Current resident size of this process (MiB)."""
    return _status_kib("VmRSS") / 1024


def measure_peak(fn: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``fn`` once; return its result and the process's resident peak during it.

    Keys: ``result``; ``peak_rss_mib`` (absolute VmHWM during fn: includes the torch
    baseline); ``base_rss_mib`` (VmRSS just before); ``peak_above_mib`` (their difference).
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    result = fn()
    hwm = _status_kib("VmHWM")
    return {"result": result, "peak_rss_mib": hwm / 1024, "base_rss_mib": before / 1024,
            "peak_above_mib": (hwm - before) / 1024}


# ---------------------------------------------------------------- timing
def measure_train_step(model: Any, compiled: Callable[..., Any], args: tuple, world: int) -> Dict[str, Any]:
    """One forward + backward of ``compiled(*args)`` (a loss) to compile and warm up, then the peak
    of the next one (:func:`measure_peak`); ``loss`` and ``seconds`` of the measured step added."""
    import torch

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = compiled(*args)
        loss.backward()
        return loss.item()

    sync = torch.distributed.barrier if world > 1 else (lambda: None)
    step()  # compile + warm-up
    sync()
    t0 = time.perf_counter()
    m = measure_peak(step)
    m["seconds"] = time.perf_counter() - t0
    m["loss"] = m.pop("result")
    return m


def timed(fn: Callable[[], Any], sync: Callable[[], Any] = lambda: None) -> float:
    """Wall seconds of ``fn()``, after ``sync()`` (e.g. a barrier so ranks start together)."""
    sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(xs))


# ---------------------------------------------------------------- processes
def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, threads: int, args: tuple) -> None:
    """Spawned-process entry: one torch thread count, a gloo group of ``world`` ranks, run ``fn``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = fn(rank, world, *args)
    finally:
        if world > 1:
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)


def run_ranks(fn: Callable, world: int, *args: Any, threads: int = 1) -> List[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh spawned processes; return each rank's result.

    ``world`` > 1 starts a gloo process group on 127.0.0.1 first; ``world`` == 1 is one
    process without a group (the single-device reference). ``fn`` must be a top-level
    (picklable) function returning a picklable value.
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)  # read by glibc at process start
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(fn, world, free_port(), tmp, threads, args), nprocs=world,
                           start_method="spawn")
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out


def try_run_ranks(fn: Callable, world: int, *args: Any, threads: int = 1) -> Any:
    """:func:`run_ranks`, but a failing run returns ``{"error": "<message>"}`` instead of raising."""
    try:
        return run_ranks(fn, world, *args, threads=threads)
    except Exception as e:  # a rank died (e.g. out of memory): record it, go on
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}


# ---------------------------------------------------------------- machine and results
def machine() -> Dict[str, Any]:
    """CPU model, core count, memory, torch version and date of this run."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, StopIteration):
        mem_gib = float("nan")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gib, 1), "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_avg_1min": round(os.getloadavg()[0], 1)}  # other work on the machine when the record was written


def command() -> str:
    """The command line that started this script, relative to the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return " ".join([".venv/bin/python", script, *map(shlex.quote, sys.argv[1:])])


def write_result(name: str, data: Dict[str, Any], started: float, args: Optional[Any] = None,
                 path: Optional[str] = None) -> str:
    """Write ``path`` (default ``benchmarks/results/<name>.json``) with the data, command, machine
    and wall time since ``started`` (a ``time.perf_counter()``)."""
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = {"benchmark": name, "command": command(), "machine": machine(),
              "wall_seconds": round(time.perf_counter() - started, 1),
              "args": vars(args) if args is not None else {}, **data}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    print(f"wrote {os.path.relpath(path, ROOT)} ({record['wall_seconds']:.0f} s)", flush=True)
    return path


def log(msg: str) -> None:
    """Progress line on stdout (run_all.py shows the last one next to its progress bar)."""
    print(msg, flush=True)


def int_list(text: str) -> List[int]:
    """argparse type: ``"4096,8192"`` or ``"4k,8k"`` -> [4096, 8192]."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out
