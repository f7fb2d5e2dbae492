"""``cp-compile doctor``: what this machine will run, each line ok or FAIL with the fix.

    $ cp-compile doctor
    ok    torch 2.13.0+cpu, Python 3.11.7
    ok    triton 3.9.0 (the kernels run on CUDA; on this CPU only under TRITON_INTERPRET=1)
    ok    CUDA: none (the CPU kernels run: aten)
    ok    cpu float32: full, causal, causal+window, documents -> aten
    ...
    ok    ring smoke: 2 ranks on gloo, causal S = 64, forward + backward within 3.1e-07 of SDPA

The kernel lines resolve ``kernel="auto"`` for each device, dtype and mask form; where the chosen
kernel checks itself (the Triton kernels on CUDA: :mod:`cp_compile.kernels.self_check`), the line
runs that check now at head dims 64 and 128 and says what ``auto`` falls back to on a failure. The
smoke starts 2 processes on the local backend (NCCL with two GPUs, else gloo on 127.0.0.1) and runs
the ring op against SDPA on the whole sequence. Exit code 1 when any line is FAIL.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

FORMS = (("full", False, False, False), ("causal", True, False, False), ("causal+window", True, True, False),
         ("documents", False, False, True))
SMOKE_TOLERANCE = 1e-4  # fp32 on CPU; (bf16 on CUDA: 2e-2)


@dataclass
class Line:
    ok: bool
    what: str
    fix: str = ""

    def __str__(self) -> str:
        tail = f" (fix: {self.fix})" if self.fix and not self.ok else ""
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.what}{tail}"


def versions() -> List[Line]:
    """torch, triton, CUDA and NCCL."""
    lines = [Line(True, f"torch {torch.__version__}, Python {platform.python_version()}")]
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    cuda = torch.cuda.is_available()
    if triton is None:
        lines.append(Line(not cuda, "triton: not installed" + ("" if cuda else " (not needed on the CPU)"),
                          "pip install triton (kernel='auto' uses the Triton kernels on CUDA)"))
    else:
        lines.append(Line(True, f"triton {triton} (the kernels run on CUDA; on the CPU only under TRITON_INTERPRET=1)"))
    if not cuda:
        lines.append(Line(True, "CUDA: none (the CPU kernels run: aten)"))
        return lines
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
    lines.append(Line(True, f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) "
                            f"({torch.cuda.get_device_name(0)}), NCCL {nccl}"))
    return lines


def kernel_lines(device: torch.device) -> List[Line]:
    """One line per dtype: the kernel "auto" runs for each mask form (self-checked where it checks itself)."""
    from ..kernels import get_kernel
    from ..kernels.self_check import Case, fallback_kernel, verdict

    dtypes = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if device.type == "cpu" else ())
    lines = []
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        try:
            kernel = get_kernel("auto", device, dtype)
        except ValueError as e:
            lines.append(Line(False, f"{device.type} {name}: {e}", "cast to a supported dtype"))
            continue
        if device.type not in getattr(kernel, "self_check_devices", ()):
            forms = ", ".join(f[0] for f in FORMS)
            lines.append(Line(True, f"{device.type} {name}: {forms} -> {kernel.name}"))
            continue
        for form, causal, window, docs in FORMS:
            failed = [f"head dim {d}: {why}" for d in (64, 128)
                      if (why := verdict(kernel, Case(kernel.name, device.type, dtype, d, causal, window, docs)))]
            back = fallback_kernel(device, dtype, window).name
            lines.append(Line(not failed, f"{device.type} {name} {form} -> {kernel.name}: "
                                          + ("self-check passed" if not failed else "; ".join(failed)),
                              f"kernel='auto' runs this case on {back!r} (warned); please report this output"))
    return lines


def smoke(world: int = 2, timeout: float = 180.0) -> Line:
    """The ring op on ``world`` local processes against SDPA: ok with its error, or FAIL with the reason."""
    import torch.multiprocessing as mp

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_smoke_rank, args=(r, world, backend, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=timeout) for _ in procs]
    except Exception as e:  # noqa: BLE001  (a hang or a crash is the verdict)
        return Line(False, f"ring smoke: {world} ranks on {backend} gave no answer ({type(e).__name__})",
                    "check that 127.0.0.1 ports are free and that torch.distributed works here")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [g for g in got if isinstance(g, str)]
    if errors:
        return Line(False, f"ring smoke: {errors[0]}", "run the failing rank's code by hand; report it")
    worst, tol = max(got), 2e-2 if backend == "nccl" else SMOKE_TOLERANCE
    return Line(worst <= tol, f"ring smoke: {world} ranks on {backend}, causal S = 64, forward + backward within "
                              f"{worst:.1e} of SDPA (tolerance {tol:.0e})", "report this output")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _smoke_rank(rank: int, world: int, backend: str, port: int, results: Any) -> None:
    try:
        results.put(_smoke_error(rank, world, backend, port))
    except Exception as e:  # noqa: BLE001  (reported, not raised: the parent prints it)
        results.put(f"rank {rank}: {type(e).__name__}: {e}")


def _smoke_error(rank: int, world: int, backend: str, port: int) -> float:
    """On a rank: the worst relative error of the ring's output and gradients against SDPA."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import cp_compile

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        dtype = torch.bfloat16 if backend == "nccl" else torch.float32
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, 64, 32, generator=g).to(device, dtype) for _ in range(3))
        local = [cp_compile.shard(t, 2).requires_grad_() for t in (q, k, v)]
        out = cp_compile.ring_attention(*local, causal=True)  # (1, 4, 64 / N, 32)
        out.float().square().sum().backward()
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, is_causal=True)
        want.float().square().sum().backward()
        pairs = [(out.detach(), cp_compile.shard(want.detach(), 2))]
        pairs += [(t.grad, cp_compile.shard(r.grad, 2)) for t, r in zip(local, ref)]
        return max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in pairs)
    finally:
        dist.destroy_process_group()


def doctor(run_smoke: bool = True) -> List[Line]:
    """Every line ``cp-compile doctor`` prints."""
    lines = versions() + kernel_lines(torch.device("cpu"))
    if torch.cuda.is_available():
        lines += kernel_lines(torch.device("cuda"))
    if run_smoke:
        lines.append(smoke())
    return lines


def cmd_doctor(args: argparse.Namespace) -> int:
    """``cp-compile doctor``: print the lines; 1 when any is FAIL."""
    lines = doctor(run_smoke=args.smoke)
    print("\n".join(map(str, lines)))
    return 0 if all(line.ok for line in lines) else 1


def add_doctor_parser(sub: Any) -> Optional[argparse.ArgumentParser]:
    p = sub.add_parser("doctor", help="versions, the kernel each dtype and mask form runs, a 2-rank ring smoke",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-smoke", dest="smoke", action="store_false", help="skip the 2-process ring smoke")
    return p


__all__ = ["Line", "add_doctor_parser", "cmd_doctor", "doctor", "kernel_lines", "smoke", "versions"]
