"""Local block-attention kernels and their registry.

``get_kernel(name, device, dtype)`` returns the kernel the ring calls for each block;
``register_kernel(kernel)`` adds one (the Triton kernels, or a test stand-in).
``"auto"`` resolves to ``"triton"`` on CUDA when Triton is installed, else ``"aten"``.
The Triton kernels (:mod:`.triton`) are imported on first use: importing Triton is
slow, and whether it runs on the CPU (its interpreter) is decided at import time from
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib.util
from typing import Dict, List

import torch

from .aten import AtenKernel
from .base import BlockKernel, StepKernel
from .reference import ReferenceKernel
from .self_check import forget_self_checks
from ..warn_once import forget_with_warnings

__all__ = ["BlockKernel", "StepKernel", "get_kernel", "register_kernel", "kernel_names"]

_REGISTRY: Dict[str, BlockKernel] = {}
TRITON = "triton"


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (not whether a GPU is there)."""
    return importlib.util.find_spec("triton") is not None


def _load_triton() -> None:
    """Register the Triton kernel on first use, or explain how to get it."""
    if TRITON in _REGISTRY:
        return
    if not triton_available():
        raise ValueError(
            "cp_compile: kernel 'triton' needs the triton package. "
            "Fix: pip install 'cp_compile[triton]' (CUDA machines), or use kernel='aten'."
        )
    from .triton import TritonKernel

    register_kernel(TritonKernel())


def register_kernel(kernel: BlockKernel, *, replace: bool = False) -> None:
    """Make ``kernel`` available as ``kernel=kernel.name`` in :func:`cp_compile.ring_attention`.

    The name is looked up by every rank inside the ring op, so register it in every
    process (at import time, or before the first call).
    """
    name = kernel.name
    if name == "auto":
        raise ValueError("cp_compile: 'auto' is reserved; give the kernel another name.")
    if name in _REGISTRY and not replace:
        raise ValueError(f"cp_compile: a kernel named {name!r} is already registered; pass replace=True.")
    _REGISTRY[name] = kernel


def kernel_names() -> List[str]:
    """Registered kernel names, plus ``"auto"`` (and ``"triton"`` when installed)."""
    names = ["auto", *_REGISTRY]
    if TRITON not in names and triton_available():
        names.append(TRITON)
    return names


def auto_kernel_name(device: torch.device) -> str:
    """What ``"auto"`` picks on ``device``: the Triton kernels on CUDA when Triton is installed
    (checked on first use per case: :mod:`.self_check`), else aten."""
    return TRITON if device.type == "cuda" and triton_available() else "aten"


def resolve_kernel_name(name: str, device: torch.device) -> str:
    """``"auto"`` -> the default kernel for ``device`` (:func:`auto_kernel_name`); other names unchanged."""
    return auto_kernel_name(device) if name == "auto" else name


def get_kernel(name: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The kernel called ``name`` for inputs on ``device`` of ``dtype``, with errors naming the fix."""
    resolved = resolve_kernel_name(name, device)
    if resolved == TRITON:
        _load_triton()
    if resolved not in _REGISTRY:
        raise ValueError(
            f"cp_compile: unknown kernel {name!r}. Fix: use one of {', '.join(map(repr, kernel_names()))} "
            "or register yours with cp_compile.kernels.register_kernel(...)."
        )
    kernel = _REGISTRY[resolved]
    if not kernel.supports(device, dtype) and hasattr(kernel, "unsupported_reason"):
        raise ValueError(f"cp_compile: kernel {resolved!r}: {kernel.unsupported_reason(device, dtype)}")
    if not kernel.supports(device, dtype):
        raise ValueError(
            f"cp_compile: kernel {resolved!r} does not support {dtype} on {device.type}. "
            "Fix: use kernel='reference' (any device/dtype, slow) or cast q/k/v to a supported dtype."
        )
    return kernel


register_kernel(AtenKernel())
register_kernel(ReferenceKernel())
forget_with_warnings(forget_self_checks)
