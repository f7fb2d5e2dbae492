"""Local block-attention kernels and their registry.

``get_kernel(name, device, dtype)`` returns the kernel the ring calls for each block;
``register_kernel(kernel)`` adds one (the Triton kernels, or a test stand-in).
``"auto"`` resolves to ``"aten"`` (the Triton kernels become the CUDA default when
they land).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from .aten import AtenKernel
from .base import BlockKernel
from .reference import ReferenceKernel

__all__ = ["BlockKernel", "get_kernel", "register_kernel", "kernel_names"]

_REGISTRY: Dict[str, BlockKernel] = {}


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
    """Registered kernel names, plus ``"auto"``."""
    return ["auto", *_REGISTRY]


def resolve_kernel_name(name: str, device: torch.device) -> str:
    """``"auto"`` -> the default kernel for ``device``; other names unchanged."""
    return "aten" if name == "auto" else name


def get_kernel(name: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The kernel called ``name`` for inputs on ``device`` of ``dtype``, with errors naming the fix."""
    resolved = resolve_kernel_name(name, device)
    if resolved not in _REGISTRY:
        raise ValueError(
            f"cp_compile: unknown kernel {name!r}. Fix: use one of {', '.join(map(repr, kernel_names()))} "
            "or register yours with cp_compile.kernels.register_kernel(...)."
        )
    kernel = _REGISTRY[resolved]
    if not kernel.supports(device, dtype):
        raise ValueError(
            f"cp_compile: kernel {resolved!r} does not support {dtype} on {device.type}. "
            "Fix: use kernel='reference' (any device/dtype, slow) or cast q/k/v to a supported dtype."
        )
    return kernel


register_kernel(AtenKernel())
register_kernel(ReferenceKernel())
