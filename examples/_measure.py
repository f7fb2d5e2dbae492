"""Peak-memory measurement shared by the examples (``ring_demo.py``, ``train_demo.py``).

``peak_mib(fn)`` is the process's resident high-water mark (VmHWM) while ``fn`` runs,
minus its resident size (VmRSS) just before; the high-water mark is first reset to
the current resident size through ``/proc/self/clear_refs``. Linux only.

For the figure to follow live tensors rather than glibc's heap retention, start the
measured processes with ``MALLOC_MMAP_THRESHOLD_`` set (``mmap_threshold_env()``):
large blocks then come straight from mmap and go back to the OS on free. Measure
after a warm-up run, so one-time costs (compilation, kernel code paged in, thread
pools, gloo connections, optimizer state) are not counted.
"""

from __future__ import annotations

import os
from typing import Callable

MMAP_THRESHOLD = "65536"


def mmap_threshold_env() -> None:
    """Set MALLOC_MMAP_THRESHOLD_ (unless already set) for processes started from now on."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_mib(fn: Callable[[], object]) -> float:
    """Resident-memory high-water mark of running ``fn``, above the resident size before it (MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def matmul_gflops(size: int = 512, repeats: int = 7, device: str = "cpu") -> float:
    """This process's fp32 matmul speed (GFLOP/s): the median of ``repeats`` ``size``³ products.

    Printed next to the demos' tokens/s so a reader can scale figures measured on another
    machine (2 CPU cores measured 66 to 200 GFLOP/s on 2 threads for the same program)."""
    import statistics
    import time

    import torch

    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    torch.matmul(a, b)  # warm-up: thread pool, kernel selection
    times = []
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9
