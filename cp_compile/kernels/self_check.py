"""Kernels that have never run on a GPU here check themselves there, on first use, and fail loudly.

    kernel = checked_kernel("auto", get_kernel("auto", q.device, q.dtype), q, causal, window, docs, group)
        first use in this process per Case (kernel, device, dtype, head dim, causal, window, documents):
            forward + backward of a tiny case — q (1, 2, 32, D), one K/V head (GQA), the case's mask
            form — on the kernel's own API, against softmax math in fp32 (fp64 for fp64 inputs)
        every rank agrees (one all_reduce MAX of the failure flag), so every rank runs one kernel
        on a mismatch or an exception:
            kernel asked for as "auto": a WARNING naming the kernel, the case and the error, and the
                case runs on the fallback kernel ("aten"; "reference" where aten cannot: a window on
                CUDA, float32 on CUDA) for the rest of the process
            kernel asked for by name: RuntimeError naming the case and the fix

Which kernels: those whose ``self_check_devices`` names the device (the Triton kernels: ``("cuda",)``,
since CI runs them only under the interpreter, on the CPU; a user's registered kernel may declare it
too). ``aten`` and ``reference``, the
fallbacks, are not checked. A FlexAttention ``mask_mod``/``score_mod`` call is not checked (its mask
is the user's code); its positions form is. :func:`forget_self_checks` (called by
:func:`cp_compile.reset_warnings`) forgets the verdicts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ..warn_once import warn_once

Tensor = torch.Tensor
log = logging.getLogger(__name__)

LENGTH, WINDOW, HEADS = 32, 8, 2  # the tiny case: 32 rows (two 16-row tiles), window 8, 2 query heads on 1 K/V head
NO_LIMIT = 2**31 - 1  # the step API's "no window" / "no padding", as the ring passes them (ring/fused.py)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 4e-2, torch.float16: 8e-3}


@dataclass(frozen=True)
class Case:
    """One form a kernel is called with: what its verdict is kept for."""

    kernel: str
    device: str
    dtype: torch.dtype
    head_dim: int
    causal: bool
    window: bool
    documents: bool

    def describe(self) -> str:
        form = "+".join(f for f, on in (("causal", self.causal), ("window", self.window),
                                         ("documents", self.documents)) if on) or "full"
        return f"{str(self.dtype).replace('torch.', '')}, head dim {self.head_dim}, {form}, on {self.device}"


_VERDICTS: Dict[Case, Optional[str]] = {}  # None: passed; else what failed


def forget_self_checks() -> None:
    """Forget every verdict: each case is checked again when next met (its WARNING is warn_once's)."""
    _VERDICTS.clear()


def checked_kernel(requested: str, kernel: Any, q: Tensor, causal: bool, window: int, documents: bool,
                   group: Any = None) -> Any:
    """``kernel`` if it passed (or needs no) self-check for this call's case, else the fallback
    (``requested == "auto"``) or a RuntimeError (a kernel asked for by name). See the module docstring."""
    if q.device.type not in getattr(kernel, "self_check_devices", ()):
        return kernel
    case = Case(kernel.name, q.device.type, q.dtype, q.shape[-1], bool(causal), window > 0, bool(documents))
    if case not in _VERDICTS:
        _VERDICTS[case] = _agreed(verdict(kernel, case), group, q.device)
    failure = _VERDICTS[case]
    if failure is None:
        return kernel
    if requested != "auto":
        raise RuntimeError(
            f"cp_compile: kernel {kernel.name!r} failed its self-check for ({case.describe()}): {failure}. Fix: "
            f"kernel='auto' (falls back to a checked kernel for this case), or kernel='aten'; please report it "
            "with the output of `cp-compile doctor`.")
    fallback = fallback_kernel(q.device, q.dtype, window > 0)
    warn_once(log, "self_check", case, "cp_compile: kernel %r failed its self-check for (%s): %s. This case runs on "
              "kernel %r in this process (exact, slower); please report it with the output of `cp-compile doctor`.",
              kernel.name, case.describe(), failure, fallback.name)
    return fallback


def fallback_kernel(device: torch.device, dtype: torch.dtype, window: bool) -> Any:
    """The kernel a failed case runs on: aten where it takes the case, else the reference kernel."""
    from . import _REGISTRY

    aten = _REGISTRY["aten"]
    if aten.supports(device, dtype) and not (window and device.type == "cuda"):  # (CUDA's flash op: no masks)
        return aten
    return _REGISTRY["reference"]


def verdict(kernel: Any, case: Case) -> Optional[str]:
    """None when ``kernel`` computes ``case`` within its dtype's tolerance, else what went wrong."""
    try:
        q, k, v, dout = _inputs(case)
        got = _run(kernel, case, q, k, v, dout)
        if got is None:
            return None  # a form the ring never gives this kernel
        want = reference(q, k, v, dout, _allowed(case, q.device))
    except Exception as e:  # noqa: BLE001  (any failure of the kernel is the verdict, named)
        return f"{type(e).__name__}: {e}"
    tol = TOLERANCE.get(case.dtype, 1e-2)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):  # the first that is off
        err = _error(g, w)
        if not err <= tol:
            return f"{name} differs from the math by {err:.2e} (tolerance {tol:.0e})"
    return None


def _agreed(failure: Optional[str], group: Any, device: torch.device) -> Optional[str]:
    """The verdict every rank of ``group`` takes: failed if it failed on any rank."""
    pg = getattr(group, "pg", None)
    if pg is None or getattr(group, "size", 1) < 2:
        return failure
    import torch.distributed as dist

    on = device if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    flag = torch.tensor([0.0 if failure is None else 1.0], device=on)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    if flag.item() and failure is None:
        return "it failed on another rank of the CP group"
    return failure


def _inputs(case: Case) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """q (1, 2, L, D), k and v (1, 1, L, D), dout like q: seeded, on the case's device and dtype."""
    g = torch.Generator().manual_seed(1234)
    shapes = [(1, HEADS, LENGTH, case.head_dim), (1, 1, LENGTH, case.head_dim), (1, 1, LENGTH, case.head_dim),
              (1, HEADS, LENGTH, case.head_dim)]
    return tuple(torch.randn(s, generator=g).to(case.device, case.dtype) for s in shapes)  # type: ignore[return-value]


def _documents(device: torch.device) -> Tensor:
    """(1, L) int32: two packed documents of 12 and 20 tokens."""
    return (torch.arange(LENGTH, device=device) >= 12).to(torch.int32).unsqueeze(0)


def _allowed(case: Case, device: torch.device) -> Tensor:
    """(L, L) bool: key j visible to query i in this case's form."""
    i = torch.arange(LENGTH, device=device)[:, None]
    j = torch.arange(LENGTH, device=device)[None, :]
    ok = torch.ones(LENGTH, LENGTH, dtype=torch.bool, device=device)
    if case.causal:
        ok &= j <= i
    if case.window:
        ok &= i - j < WINDOW
    if case.documents:
        doc = _documents(device)[0]
        ok &= doc[:, None] == doc[None, :]
    return ok


def _run(kernel: Any, case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> Optional[Tuple[Tensor, ...]]:
    """(out, lse, dq, dk, dv) from the kernel's own API, or None for a form the ring never gives it."""
    scale = 1.0 / math.sqrt(case.head_dim)
    if getattr(kernel, "fuses_merge", False):
        return _run_steps(kernel, case, q, k, v, dout, scale)
    mask = None
    if case.window or case.documents:
        if not getattr(kernel, "supports_masks", False):
            return None
        mask = torch.zeros(LENGTH, LENGTH, device=q.device).masked_fill(~_allowed(case, q.device), float("-inf"))
    extra = {} if mask is None else {"mask": mask}
    causal = case.causal and mask is None  # (a mask carries the causal part too)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, **extra)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, **extra)
    return out, lse, dq, dk, dv


def _run_steps(kernel: Any, case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor,
               scale: float) -> Optional[Tuple[Tensor, ...]]:
    """The step API (a kernel that fuses the ring's merge): one step over the whole case."""
    if case.documents and not getattr(kernel, "supports_doc_ids", False):
        return None
    pos = torch.arange(LENGTH, dtype=torch.int32, device=q.device)
    kw: Dict[str, Any] = {"causal": case.causal, "scale": scale, "kv_limit": NO_LIMIT,
                          "window": WINDOW if case.window else NO_LIMIT}
    if case.documents:
        kw["q_doc"] = kw["k_doc"] = _documents(q.device)
    state = kernel.new_state(q)
    kernel.forward_step(q, k, v, state, pos, pos, **kw)
    out, lse = kernel.finalize(state, q.dtype)
    grads = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    kernel.backward_step(dout, q, k, v, lse, kernel.delta(dout, out), grads, pos, pos, **kw)
    return (out, lse, *grads)


def reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, allowed: Tensor) -> Tuple[Tensor, ...]:
    """(out, lse, dq, dk, dv) of softmax(q kᵀ / √D, masked to ``allowed``) v by the formulas, in fp32
    (fp64 for fp64): q, dout (B, H, L, D); k, v (B, 1, L, D), shared by the H heads."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, dout = (t.to(ct) for t in (q, k, v, dout))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))  # (B, H, L, L)
    lse = torch.logsumexp(s, -1)  # (B, H, L)
    p = torch.exp(s - lse[..., None])
    out = p @ v
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = ds @ k * scale
    dk = (ds.transpose(-1, -2) @ q * scale).sum(1, keepdim=True)  # (B, 1, L, D): the heads that share it
    dv = (p.transpose(-1, -2) @ dout).sum(1, keepdim=True)
    return out, lse, dq, dk, dv


def _error(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in fp64 (absolute where want is 0); inf for a shape or NaN mismatch."""
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    den = want.norm().item()
    err = (got - want).norm().item()
    return err / den if den > 0 else err


__all__ = ["Case", "checked_kernel", "fallback_kernel", "forget_self_checks", "reference", "verdict"]
