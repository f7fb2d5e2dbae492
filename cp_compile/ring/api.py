"""``ring_attention``: the public, eager-usable and traceable entry of the ring op."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .._group import resolve_group
from ..config import RingOptions
from ..kernels import get_kernel
from ..layout import check_seq_len
from .agree import check_device

Tensor = torch.Tensor


def _fail(msg: str) -> None:
    raise ValueError(f"cp_compile.ring_attention: {msg}")


def _check_tensors(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shapes, dtypes and devices of the local shards, with errors that name the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a Tensor, got {type(t).__name__}. Fix: pass torch.Tensor shards from cp_compile.shard.")
        if t.dim() != 4:
            _fail(
                f"{name} has shape {tuple(t.shape)}; expected 4 dims (B, H, S_local, D). "
                "Fix: transpose (B, S, H, D) activations with .transpose(1, 2) as for F.scaled_dot_product_attention."
            )
        if not t.dtype.is_floating_point:
            _fail(f"{name} has dtype {t.dtype}; expected a floating-point dtype. Fix: cast to float32/bfloat16/float16.")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}). Fix: cast them to one dtype.")
    if not (q.device == k.device == v.device):
        _fail(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}). Fix: move them to one device.")
    if k.shape != v.shape:
        _fail(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape (one K/V block travels "
            "per step). Fix: project v to k's head count and head dim."
        )
    (b, h, s, d), (bk, hk, sk, dk) = q.shape, k.shape
    if b != bk or d != dk:
        _fail(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head dim (dim 3). "
            "Fix: pass q, k, v of the same batch, laid out (B, H, S_local, D)."
        )
    if s != sk:
        _fail(
            f"q has {s} local tokens but k has {sk}: the ring attends each rank's queries to the "
            "keys of the same sequence, sharded the same way. Fix: shard q, k and v with one layout."
        )
    if hk == 0 or h % hk != 0:
        _fail(
            f"q has {h} heads, not a multiple of k's {hk} heads (GQA needs H % H_kv == 0). "
            "Fix: check the head counts of the q/k/v projections."
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    group: Any = None,
    load_balance: str = "zigzag",
    rotate: str = "p2p",
    kernel: str = "auto",
    timeout: Optional[float] = None,
) -> Tensor:
    """Exact attention over a sequence split across the ranks of a CP group.

    Args:
        q: (B, H, S_local, D) this rank's queries, as laid out by
            ``cp_compile.shard(x, dim=2, load_balance=load_balance)``.
        k, v: (B, H_kv, S_local, D), H % H_kv == 0 (GQA/MQA: only H_kv heads travel).
        causal: causal mask over *global* positions.
        scale: softmax scale; default 1/sqrt(D).
        group: None (default process group), a ProcessGroup or a DeviceMesh (1-D or
            with a dim named "cp").
        load_balance: "zigzag" | "striped" | "contiguous" (must match the sharding).
        rotate: "p2p" (double-buffered ring) | "allgather".
        kernel: "auto" (CUDA: "triton" if installed; else "aten") | "aten" | "triton"
            | "reference" | a registered kernel name.
        timeout: seconds each wait for a peer may take before the op raises
            ``cp_compile.ring.faults.RingCommError`` naming the peer, ring step and
            direction; None (default): the process group's own timeout.

    Returns:
        (B, H, S_local, D): this rank's rows of softmax(q kᵀ · scale + mask) v over the
        full sequence. Differentiable (the backward is the ring too). With a CP group
        of size 1 this is ``F.scaled_dot_product_attention``.
    """
    _check_tensors(q, k, v)
    opts = RingOptions(load_balance=load_balance, rotate=rotate, kernel=kernel, timeout=timeout)
    g = resolve_group(group)
    check_seq_len(q.shape[2] * g.size, g.size, opts.load_balance)
    if not torch.compiler.is_compiling():  # traced: the op checks it when it runs
        check_device(g, q.device)  # a device the group cannot move: fail here, on every rank
    get_kernel(opts.kernel, q.device, q.dtype)  # unknown or unsupported kernel: fail here, on every rank
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if g.size == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    out, _ = torch.ops.cp_compile.ring_attention_fwd(
        q, k, v, bool(causal), scale, g.name, opts.load_balance, opts.rotate, opts.kernel,
        timeout=opts.timeout or -1.0,
    )
    return out
