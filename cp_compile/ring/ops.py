"""``torch.library`` custom ops for ring attention, so compiled graphs keep it whole.

``cp_compile::ring_attention_fwd(q, k, v, ...) -> (out, lse)`` and
``cp_compile::ring_attention_bwd(dout, q, k, v, out, lse, ...) -> (dq, dk, dv)``
are opaque to Dynamo/AOTAutograd (no graph break, no tracing into the
communication), have fake implementations for shape propagation, and are linked by
``register_autograd``. The process group travels as its registered name, since
custom ops take only tensors and plain values; ``timeout`` (seconds, ``-1``: the
process group's own) bounds every wait of the ring (:mod:`.faults`). The first
forward call with given arguments checks that every rank passed the same ones
(:mod:`.agree`).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..group import group_by_name
from ..kernels import get_kernel
from .agree import check_device, check_same_call, metadata
from .faults import RingGroup
from .loops import ring_backward, ring_forward
from .masking import MaskSpec

Tensor = torch.Tensor


def _run_options(group_name: str, kernel: str, q: Tensor, timeout: float, phase: str) -> dict:
    """The group (with its wait limit and phase, see :class:`.faults.RingGroup`) and the kernel."""
    g = group_by_name(group_name)
    group = RingGroup(g.pg, g.rank, g.size, timeout=timeout if timeout > 0 else None, phase=phase)
    check_device(group, q.device)
    return {"group": group, "kernel": get_kernel(kernel, q.device, q.dtype)}


@torch.library.custom_op("cp_compile::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
    group_name: str, load_balance: str, rotate: str, kernel: str, valid_len: int = -1, timeout: float = -1.0,
    window: int = -1, attn_mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact attention of local q over the CP group's whole K/V: (out, lse (B, H, c) fp32).

    ``valid_len`` >= 0: global positions from there on are padding (never attended).
    ``timeout`` > 0: seconds each ring wait may take (else the process group's timeout).
    ``window`` > 0 (causal): sliding window; ``attn_mask``: this rank's rows of an
    additive float32 mask, (B|1, H|1, c, N·c) (see :mod:`.masking`)."""
    opts = _run_options(group_name, kernel, q, timeout, "forward")
    meta = metadata(q, k, v, causal, scale, load_balance, rotate, opts["kernel"].name, valid_len, window,
                    attn_mask)
    check_same_call(meta, opts["group"], q.device, opts["kernel"].name)
    return ring_forward(
        q, k, v, causal=causal, scale=scale, load_balance=load_balance, rotate=rotate, valid_len=valid_len,
        spec=MaskSpec(window, attn_mask), **opts
    )


@ring_attention_fwd.register_fake
def _(q, k, v, causal, scale, group_name, load_balance, rotate, kernel, valid_len=-1, timeout=-1.0, window=-1,
      attn_mask=None):
    # The real op returns fresh contiguous tensors whatever the input strides.
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("cp_compile::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
    scale: float, group_name: str, load_balance: str, rotate: str, kernel: str, valid_len: int = -1,
    timeout: float = -1.0, window: int = -1, attn_mask: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of the local shards: (dq, dk, dv), dK/dV summed over every rank's queries."""
    opts = _run_options(group_name, kernel, q, timeout, "backward")
    return ring_backward(
        dout, q, k, v, out, lse, causal=causal, scale=scale, load_balance=load_balance, rotate=rotate,
        valid_len=valid_len, spec=MaskSpec(window, attn_mask), **opts,
    )


@ring_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, scale, group_name, load_balance, rotate, kernel, valid_len=-1, timeout=-1.0,
      window=-1, attn_mask=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, like the real op


_OPTION_NAMES = ("causal", "scale", "group_name", "load_balance", "rotate", "kernel", "valid_len", "timeout",
                 "window")  # then attn_mask, a tensor


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    q, k, v, *options = inputs
    out, lse = output
    attn_mask = options[len(_OPTION_NAMES)] if len(options) > len(_OPTION_NAMES) else None
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.options = dict(zip(_OPTION_NAMES, options))
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, dout: Tensor, _dlse: Any):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    o = ctx.options
    dq, dk, dv = ring_attention_bwd(
        dout.contiguous(), q, k, v, out, lse, o["causal"], o["scale"], o["group_name"],
        o["load_balance"], o["rotate"], o["kernel"], o.get("valid_len", -1), o.get("timeout", -1.0),
        o.get("window", -1), attn_mask,
    )
    return (dq, dk, dv) + (None,) * (len(_OPTION_NAMES) + 1)


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
