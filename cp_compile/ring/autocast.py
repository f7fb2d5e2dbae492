"""Autocast for the ring op: the rule ``torch.autocast`` applies to ``F.scaled_dot_product_attention``.

Under ``torch.autocast(device, dtype)`` SDPA is a lower-precision op: each floating-point
argument on that device, float64 excepted, is cast to the autocast dtype, and the op runs with
autocast off. A model's q and k can arrive in float32 (Hugging Face's RoPE multiplies the bf16
projections by float32 cos/sin) and v in bf16; eager SDPA casts all three. The ring op replaces
SDPA, so it gets the same rule, as an ``Autocast<Device>`` kernel of
``cp_compile::ring_attention_fwd`` (:func:`register`): it casts q, k, v as above, to the dtype
autocast has *at the call* (bf16 or fp16, whichever the user chose), and calls the op below
autocast. The explicit mask and the mods' buffers are left as they are (the kernels read the mask
in their compute dtype), and the merge keeps its float32 accumulators.

One rule serves every way the op is reached: the compiled graph (AOTAutograd traces the rewritten
graph under the ambient autocast, and under the ``_enter_autocast`` / ``_exit_autocast`` nodes
Dynamo records for an autocast region inside the compiled code, so the casts are baked into the
graph and the op's fake values have SDPA's dtypes), ``inner="eager"`` and
:func:`cp_compile.ring_attention` called eagerly. The backward op has no such rule: its inputs are
the forward's cast tensors and their gradients, already in one dtype.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

Tensor = torch.Tensor

# Where the ring runs (gloo moves CPU tensors, nccl CUDA ones); the rule is the same for each.
DEVICES = ("cpu", "cuda")


def sdpa_dtype(t: Tensor, device_type: str) -> torch.dtype:
    """The dtype the op gets ``t`` in under the current autocast of ``device_type`` (one of :data:`DEVICES`,
    where the rule is registered), as SDPA gets it: the autocast dtype for a floating-point tensor on
    that device that is not float64 (``at::autocast::cached_cast``'s eligibility) while autocast is on
    there, else ``t.dtype``."""
    if device_type not in DEVICES or not torch.is_autocast_enabled(device_type):
        return t.dtype
    eligible = t.is_floating_point() and t.device.type == device_type and t.dtype is not torch.float64
    return torch.get_autocast_dtype(device_type) if eligible else t.dtype


def sdpa_cast(tensors: Tuple[Tensor, ...], device_type: str) -> Tuple[Tensor, ...]:
    """``tensors`` cast as SDPA's are under the current autocast of ``device_type`` (:func:`sdpa_dtype`)."""
    return tuple(t.to(sdpa_dtype(t, device_type)) for t in tensors)


def _autocast_kernel(op: torch._ops.OpOverload, device_type: str) -> Callable:
    """The op's kernel for the ``Autocast<Device>`` dispatch key of ``device_type`` (the dispatcher calls it
    only while autocast is on there): q, k, v cast by :func:`sdpa_cast`, then the op with that
    autocast key excluded, as ``torch.library.register_autocast`` and ATen's autocast kernels do."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def kernel(q: Tensor, k: Tensor, v: Tensor, *rest, **kwargs):
        q, k, v = sdpa_cast((q, k, v), device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(q, k, v, *rest, **kwargs)

    return kernel


def register(op: torch._ops.OpOverload) -> None:
    """Give ``op`` (whose first three arguments are q, k, v) SDPA's autocast rule on :data:`DEVICES`.

    ``torch.library.register_autocast`` is not used: it casts to one dtype fixed when it is
    registered, and every floating-point argument (the mask and the mods' buffers too)."""
    for device_type in DEVICES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        torch.library.impl(op.name(), key, _autocast_kernel(op, device_type))
