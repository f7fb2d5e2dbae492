"""Run every benchmark at its default size, then write results/RESULTS.md and the PNG plots.

    .venv/bin/python benchmarks/run_all.py                 # all, defaults (under 20 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick         # tiny sizes: a smoke test of the pipeline (~6 min)
    .venv/bin/python benchmarks/run_all.py --only memory,balance
    .venv/bin/python benchmarks/report.py                  # re-render RESULTS.md from the JSON records

Each benchmark runs as its own subprocess (``benchmarks/bench_*.py``, each with
``--help``); a text progress bar shows the step, elapsed time and the script's last
output line. A failing benchmark is reported and the others still run; RESULTS.md
then says "not run" (or keeps that benchmark's previous record, with its own
command and date) for it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import common

# name: (script, extra args at --quick size). Default sizes are each script's own defaults.
BENCHES: Dict[str, Tuple[str, List[str]]] = {
    "kernel": ("bench_kernel.py", ["--lens", "512", "--repeats", "2"]),
    "error": ("bench_error.py", ["--seq-len", "512", "--triton", "off"]),
    "balance": ("bench_balance.py", ["--local-len", "256", "--worlds", "2,4", "--real-worlds", "2", "--repeats", "2"]),
    "overlap": ("bench_overlap.py", ["--local-len", "32768", "--sleep", "0.05", "--real-seq-len", "2048",
                                     "--repeats", "2"]),
    "vs_torch_cp": ("bench_vs_torch_cp.py", ["--seq-len", "1024", "--repeats", "2"]),
    "memory": ("bench_memory.py", ["--seq-lens", "1k,2k", "--llama-seq-lens", "1k", "--worlds", "1,2"]),
    "e2e": ("bench_e2e.py", ["--seq-len", "1024", "--steps", "2"]),
    "compile": ("bench_compile.py", ["--seq-len", "256"]),
    "doc_memory": ("bench_doc_memory.py", ["--seq-lens", "4k", "--worlds", "1,2"]),
    "doc_balance": ("bench_doc_balance.py", ["--quick"]),
    "strategies": ("bench_strategies.py", ["--seq-len", "256", "--steps", "1"]),
}


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def run_one(name: str, cmd: List[str], i: int, total: int, t_all: float) -> int:
    """Run one benchmark, echoing its output, with a progress line per output line."""
    tty = sys.stderr.isatty()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MALLOC_MMAP_THRESHOLD_": common.MMAP_THRESHOLD}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=common.ROOT)
    t0 = time.perf_counter()
    log_path = os.path.join(common.RESULTS, f"{name}.log.tmp")  # gitignored (*.tmp)
    with open(log_path, "w") as log:
        for line in proc.stdout:
            log.write(line)
            line = line.rstrip()
            if not line or "Terminating process" in line:
                continue
            el, el_all = time.perf_counter() - t0, time.perf_counter() - t_all
            status = f"{_bar(i - 1, total)} {i}/{total} {name} {el:4.0f} s (total {el_all / 60:4.1f} min) | {line[:90]}"
            print(("\r\033[K" + status) if tty else status, file=sys.stderr, end="" if tty else "\n", flush=True)
    rc = proc.wait()
    if tty:
        print(file=sys.stderr)
    if rc != 0:
        print(f"!! {name} failed (exit {rc}); its output is in {os.path.relpath(log_path, common.ROOT)}",
              file=sys.stderr, flush=True)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--quick", action="store_true", help="tiny sizes (pipeline smoke test; numbers not meaningful)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHES)}")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = set(names) - set(BENCHES)
    if unknown:
        p.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {', '.join(BENCHES)}")
    os.makedirs(common.RESULTS, exist_ok=True)
    started = time.perf_counter()
    failed = []
    for i, name in enumerate(names, 1):
        script, quick = BENCHES[name]
        cmd = [sys.executable, os.path.join(common.HERE, script), *(quick if args.quick else [])]
        if run_one(name, cmd, i, len(names), started):
            failed.append(name)
    if not args.only:  # the full run's record (command, total time) heads RESULTS.md; --only keeps it
        common.write_result("run_all", {"ran": names, "failed": failed, "quick": args.quick}, started, args)
    import report

    report.render()
    total = time.perf_counter() - started
    print(f"{_bar(1, 1)} done in {total / 60:.1f} min; wrote benchmarks/results/RESULTS.md"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
