"""``ring_attention``: the public, eager-usable and traceable entry of the ring op."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..group import resolve_group
from ..options import RingOptions
from ..kernels import get_kernel
from ..sequence import check_seq_len, check_table
from .agree import check_device
from .autocast import sdpa_dtype
from .masking import additive_mask
from .mods import Mods, register_mods

Tensor = torch.Tensor


def _fail(msg: str) -> None:
    raise ValueError(f"cp_compile.ring_attention: {msg}")


def _check_tensors(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shapes, dtypes and devices of the local shards, with errors that name the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if len({sdpa_dtype(t, q.device.type) for t in (q, k, v)}) != 1:  # under autocast, as the op casts them
        _fail(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}). Fix: cast them to one dtype.")
    if not (q.device == k.device == v.device):
        _fail(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}). Fix: move them to one device.")
    _check_shapes(q, k, v)


def _check_tensor(name: str, t: Tensor) -> None:
    """One of q, k, v on its own: a floating-point tensor laid out (B, H, S_local, D)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a Tensor, got {type(t).__name__}. "
              "Fix: pass torch.Tensor shards from cp_compile.shard.")
    if t.dim() != 4:
        _fail(
            f"{name} has shape {tuple(t.shape)}; expected 4 dims (B, H, S_local, D). "
            "Fix: transpose (B, S, H, D) activations with .transpose(1, 2) as for F.scaled_dot_product_attention."
        )
    if not t.dtype.is_floating_point:
        _fail(f"{name} has dtype {t.dtype}; expected a floating-point dtype. "
              "Fix: cast to float32/bfloat16/float16.")


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q (B, H, S_local, D), k and v (B, H_kv, S_local, D) agree: one K/V shape, the same batch,
    head dim and local length as q, and H a multiple of H_kv."""
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


def _check_window(window: Optional[int], causal: bool) -> int:
    if window is None:
        return -1
    if not causal or isinstance(window, bool) or not isinstance(window, int) or window < 1:
        _fail(
            f"window={window!r}: a sliding window is a positive int and needs causal=True "
            "(query i sees keys i-window+1..i). Fix: pass causal=True, window=W."
        )
    return window


def _check_kernel_masks(kern: Any, window: int, mask: Optional[Tensor]) -> None:
    """Block kernels need ``supports_masks`` for a window or a mask; fused ones do windows natively."""
    needs = mask is not None or (window > 0 and not getattr(kern, "fuses_merge", False))
    if needs and not getattr(kern, "supports_masks", False):
        _fail(f"kernel {kern.name!r} takes no masks, which window= and attn_mask= need. Fix: kernel='aten'.")


def _local_mask(mask: Tensor, q: Tensor, n: int, causal: bool, kernel: str) -> Tensor:
    """The user's mask rows as additive float32 (B|1, H|1, c, S), or an error naming the fix."""
    b, h, c, _ = q.shape
    s = c * n
    if causal:
        _fail("attn_mask and causal=True together (as in F.scaled_dot_product_attention, pick one). "
              "Fix: fold causality into the mask, or pass causal=True without a mask.")
    if mask.requires_grad:
        _fail("attn_mask requires grad; the ring treats masks as constants. Fix: pass attn_mask.detach().")
    if mask.device != q.device:
        _fail(f"attn_mask is on {mask.device}, q on {q.device}. Fix: move the mask to q's device.")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    ok = m.dim() == 4 and m.shape[0] in (1, b) and m.shape[1] in (1, h) and m.shape[2] in (1, c) and m.shape[3] == s
    if not ok:
        _fail(
            f"attn_mask has shape {tuple(mask.shape)}; expected this rank's query rows over all keys, "
            f"broadcastable to (B={b}, H={h}, S_local={c} or 1, S={s}). Fix: pass cp_compile.shard(mask, dim=-2) "
            "of the full (..., S, S) mask, with the same load_balance."
        )
    if kernel == "triton" or (kernel == "auto" and q.device.type == "cuda"):
        _fail("the Triton kernels take no explicit attn_mask (they mask by position). "
              "Fix: causal=True / window=W when the mask is one of those, else kernel='aten' (CPU).")
    return additive_mask(m)


def _check_doc_ids(doc_ids: Tensor, q: Tensor, n: int) -> Tensor:
    """``doc_ids`` as (B|1, S) with errors that name the fix."""
    b, s = q.shape[0], q.shape[2] * n
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype not in (torch.int32, torch.int64):
        what = doc_ids.dtype if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        _fail(f"doc_ids must be an int32 or int64 tensor, got {what}. Fix: pass integer document ids, e.g. "
              "cp_compile.doc_ids_from_cu_seqlens(cu_seqlens, S) or "
              "cp_compile.doc_ids_from_position_ids(position_ids).")
    ids = doc_ids.unsqueeze(0) if doc_ids.dim() == 1 else doc_ids
    if ids.dim() != 2 or ids.shape[0] not in (1, b) or ids.shape[1] != s:
        _fail(
            f"doc_ids has shape {tuple(doc_ids.shape)}; expected (B={b} or 1, S={s}): one id per position of the "
            "WHOLE sequence in global order, the same tensor on every rank. Fix: pass the full, unsharded "
            "doc_ids (not cp_compile.shard(...) of it)."
        )
    if ids.device != q.device:
        _fail(f"doc_ids is on {ids.device}, q on {q.device}. Fix: move doc_ids to q's device.")
    return ids


def _check_buffers(name: str, buffers: Optional[Sequence[Tensor]], mod: Optional[Callable], q: Tensor) -> List[Tensor]:
    """The mods' buffers as a list of tensors on q's device (score buffers may require grad; mask buffers are
    constants), or an error naming the fix."""
    if buffers is None:
        return []
    if mod is None:
        _fail(f"{name} given without the mod that reads it. Fix: pass {name.split('_')[0]}_mod=..., or drop {name}.")
    if isinstance(buffers, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in buffers):
        _fail(f"{name} must be a list of tensors. Fix: pass {name}=[t1, t2, ...] in the order the mod reads them.")
    for t in buffers:
        if t.requires_grad and name == "mask_buffers":
            _fail("a mask_buffers tensor requires grad; a mask_mod's result is boolean, so its buffers get no "
                  "gradient. Fix: pass it .detach(), or read the learned tensor in the score_mod (score_buffers "
                  "may require grad).")
        if t.device != q.device:
            _fail(f"a {name} tensor is on {t.device}, q on {q.device}. Fix: move it to q's device.")
    return list(buffers)


def _check_mods(mask_mod: Optional[Callable], score_mod: Optional[Callable], mask_buffers: Any, score_buffers: Any,
                q: Tensor, kern: Any) -> Tuple[str, List[Tensor], List[Tensor]]:
    """(mods key, mask buffers, score buffers) for the ring op."""
    mb = _check_buffers("mask_buffers", mask_buffers, mask_mod, q)
    sb = _check_buffers("score_buffers", score_buffers, score_mod, q)
    if mask_mod is None and score_mod is None:
        return _register_mods(mask_mod, score_mod), mb, sb
    if getattr(kern, "fuses_merge", False) and not getattr(kern, "supports_mods", False):
        _fail(f"kernel {kern.name!r} takes no mask_mod / score_mod (it masks by position and document id only). "
              "Fix: use kernel='aten' on CPU or kernel='reference', or pass packed documents as doc_ids=.")
    if mask_mod is not None and not (getattr(kern, "supports_masks", False) or getattr(kern, "supports_mods", False)):
        _fail(f"kernel {kern.name!r} takes no masks, which mask_mod= needs. Fix: kernel='aten' or 'reference'.")
    if hasattr(kern, "check_mods") and not torch.compiler.is_compiling():  # a mod the kernel cannot run fails now,
        # before any collective (under torch.compile the ring op's own check does it at run time)
        kern.check_mods(Mods(mask_mod, score_mod, tuple(mb), tuple(sb)), q.device)
    return _register_mods(mask_mod, score_mod), mb, sb


# Traced by torch.compile, the key is computed once at trace time and baked in as a constant (it depends
# only on the functions, which Dynamo guards on), instead of a graph break on hashlib.
_register_mods = torch.compiler.assume_constant_result(register_mods)


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
    window: Optional[int] = None,
    attn_mask: Optional[Tensor] = None,
    doc_ids: Optional[Tensor] = None,
    mask_mod: Optional[Callable[..., Tensor]] = None,
    score_mod: Optional[Callable[..., Tensor]] = None,
    mask_buffers: Optional[Sequence[Tensor]] = None,
    score_buffers: Optional[Sequence[Tensor]] = None,
    positions: Optional[Tensor] = None,
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
        window: with ``causal=True``, a sliding window: query i sees keys i-window+1..i
            (global positions), as Mistral's ``sliding_window``. Steps wholly outside
            the window are skipped; no S x S mask is built.
        attn_mask: without ``causal``, this rank's query rows of an explicit mask over
            the full sequence: bool (True = attend) or additive float, broadcastable
            to (B, H, S_local, S) with keys in global order, e.g.
            ``cp_compile.shard(full_mask, dim=-2)``; a key-padding mask
            (B, 1, 1, S) is broadcast over the rows. O(S_local x S) memory per rank:
            prefer ``causal``/``window`` when the mask is one of those.
        doc_ids: packed documents, (B or 1, S) int32/int64 ids of the WHOLE sequence in
            global order (the same tensor on every rank; ``cp_compile.doc_ids_from_*``): keys
            are visible only within the query's document. No mask is built, and pairs across
            documents are never computed.
        mask_mod, score_mod: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx, *mask_buffers)``
            (True = attend) and ``score_mod(score, b, h, q_idx, kv_idx, *score_buffers)`` over
            GLOBAL positions (docs/kernels.md, "Documents and mods"); ``mask_buffers`` /
            ``score_buffers``: the tensors they read, whole (the same tensor on every rank).
            ``score_buffers`` may require grad (a learned relative-position bias table, learned
            ALiBi slopes): each rank's backward then gives the buffer THIS RANK'S SHARE of its
            gradient (its queries' part); sum the shares over the CP group, as for every other
            parameter of a context-parallel model (an all-reduce of the parameter gradients over the
            CP group, folded into data parallelism's or done by the ``ring_cp`` backend).
            ``mask_buffers`` are constants (no grad).
        positions: a layout computed per batch, in place of ``load_balance``: an (N, S_local)
            int64 table whose row r lists rank r's global positions, sorted, the rows a
            partition of range(S), the same whole tensor on every rank (e.g.
            ``cp_compile.document_layout.layout_table(doc_lengths, N)``, balanced for packed
            documents); shard q, k, v with ``cp_compile.shard(x, 2, positions=table)``. One table
            serves the whole batch (docs/api.md, "A layout computed per batch").
        timeout: seconds each wait for a peer may take before the op raises
            ``cp_compile.ring.faults.RingCommError`` naming the peer, ring step and
            direction; None (default): the process group's own timeout.

    Returns:
        (B, H, S_local, D): this rank's rows of softmax(q kᵀ · scale + mask) v over the
        full sequence. Differentiable (the backward is the ring too). With a CP group
        of size 1 and no window, mask, doc_ids or mods this is ``F.scaled_dot_product_attention``.
    """
    _check_tensors(q, k, v)
    window = _check_window(window, causal)  # -1: none
    opts = RingOptions(load_balance=load_balance, rotate=rotate, kernel=kernel, timeout=timeout)
    g = resolve_group(group)
    if positions is None:
        check_seq_len(q.shape[2] * g.size, g.size, opts.load_balance)
    elif not torch.compiler.is_compiling():  # traced: the op checks it when it runs
        positions = check_table(positions, g.size, q.shape[2] * g.size)  # (N, c) int64 on the CPU
    if not torch.compiler.is_compiling():  # traced: the op checks it when it runs
        check_device(g, q.device)  # a device the group cannot move: fail here, on every rank
    # unknown or unsupported kernel (for q's dtype as the op gets it): fail here, on every rank
    kern = get_kernel(opts.kernel, q.device, sdpa_dtype(q, q.device.type))
    mask = None if attn_mask is None else _local_mask(attn_mask, q, g.size, causal, opts.kernel)
    _check_kernel_masks(kern, window, mask)
    docs = None if doc_ids is None else _check_doc_ids(doc_ids, q, g.size)
    mods, mb, sb = _check_mods(mask_mod, score_mod, mask_buffers, score_buffers, q, kern)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if g.size == 1 and window < 0 and mask is None and docs is None and not mods:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    out, _ = torch.ops.cp_compile.ring_attention_fwd(
        q, k, v, bool(causal), scale, g.name, opts.load_balance, opts.rotate, opts.kernel,
        timeout=opts.timeout or -1.0, window=window, attn_mask=mask, doc_ids=docs, mods=mods,
        mask_buffers=mb or None, score_buffers=sb or None, positions=positions,
    )
    return out
