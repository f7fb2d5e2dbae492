"""Forward ring-step kernel: one visiting K/V block merged into fp32 accumulators in place.

Math (docs/design.md §1). For a query row with scores ``s_j = scale · q·k_j`` over the keys
seen so far, the running state is::

    m = max_j s_j                      (M, float32; -inf before any key)
    l = Σ_j exp(s_j - m)               (L, float32)
    acc = Σ_j exp(s_j - m) · v_j       (ACC, float32, un-normalised)

A step streams the visiting block in BLOCK_N-key tiles and updates the state with the
online-softmax recurrence (``α = exp(m_old - m_new)``: ``l ← α l + Σ p``,
``acc ← α acc + p·V``), which *is* the exact merge of this block's partial result
with all earlier ones, done in fp32 registers: no per-step output is ever rounded to
the input dtype. :func:`finalize` turns the state into ``out = acc / l`` and
``lse = m + log l``; a row that saw no key gets out = 0, lse = -inf.

Natural units, not base 2: the usual trick of folding log2(e) into the scale rounds
every logit once more at its own magnitude (ulp 1.2e-4 at |t| ~ 1.4e3), which cost
2e-5 relative error on logits ~1e3 (measured); ``exp(s - m)`` keeps ``s - m`` exact,
and m and l stay apart across ring steps, so the merge never rounds an lse either.

Masking is by *global token position*: key j is visible to query i iff
``kpos[j] < kv_limit``, ``qpos[i] - kpos[j] < window`` and, when causal,
``kpos[j] <= qpos[i]``. This one rule gives every layout's pattern (zig-zag halves,
striped diagonal in/excluded, padding at the end) and sliding windows. A tile whose
every pair is masked (``min kpos > max qpos``, ``min qpos - max kpos >= window`` or
``min kpos >= kv_limit``) is skipped before any Q/K/V data is loaded for it.

Packed documents (``DOCS``): with per-row document ids QDOC (B|1, S_q) and KDOC
(B|1, S_k) int32, key j is visible to query i only if also ``qdoc[i] == kdoc[j]``.
A tile is skipped, before K/V are loaded, when the document ranges of its query and
key rows do not meet (``max kdoc < min qdoc`` or ``min kdoc > max qdoc``). Documents
are contiguous position ranges and a block's rows are in increasing position, so the
ids are sorted along a block and these ranges are tight; with unsorted ids the test
stays sound (it only skips tiles with no shared document), just less often.

Precision: Q·Kᵀ and P·V take their operands in the input dtype (tensor cores) and
accumulate in fp32; P is rounded to the input dtype for P·V, as in every flash
kernel (measured: the bf16 output error then equals PyTorch's CPU flash kernel's).

Shapes: Q (B, H, S_q, D); K, V (B, H_kv, S_k, D), query head h reads K/V head
h // GROUP with GROUP = H / H_kv (no K/V copy); ACC (B, H, S_q, D) fp32 contiguous;
M, L (B, H, S_q) fp32 contiguous; QPOS (S_q,), KPOS (S_k,) int32; QDOC, KDOC row-major
int32 whose batch stride is 0 when one row of ids serves every batch row.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .configs import FWD_CONFIGS, INTERPRET, KEY, Tiles, fixed_tiles, padded_head_dim
from .mods import mod_args

Tensor = torch.Tensor
NO_LIMIT = 2**31 - 1  # kv_limit meaning "no padding"


@triton.jit
def dot(a, b, INTERP: tl.constexpr):
    """a @ b with fp32 accumulation (fp32 inputs in IEEE precision, never TF32).

    Triton's interpreter mis-multiplies bfloat16 tiles, so under it the operands are
    widened to fp32 first. That is what the GPU computes: products of two bf16/fp16
    values are exact in fp32 and tensor cores accumulate in fp32.
    """
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` to ``dtype``, rounding to nearest even as the GPU does.

    Triton's interpreter truncates fp32 -> bf16, which would double every bf16
    rounding error in the CPU tests, so there the rounding is done by hand on the bits
    (add half an ulp, ties to even, then cut; finite values only).
    """
    if INTERP and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def visible_pairs(q_pos, k_pos, kv_limit, window, q_doc, k_doc, CAUSAL: tl.constexpr, DOCS: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool: key visible to query by global positions and, with DOCS,
    by equal document ids (module docstring)."""
    visible = (k_pos < kv_limit)[None, :] & ((q_pos[:, None] - k_pos[None, :]) < window)
    if CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    if DOCS:
        visible = visible & (q_doc[:, None] == k_doc[None, :])
    return visible


@triton.jit
def doc_rows(DOC, b, s_docb, offs, ok, DOCS: tl.constexpr):
    """Document ids of rows ``offs`` of batch row ``b``: (ids (BLOCK,) int32, min and max over
    the in-range rows). Without DOCS nothing is loaded: (offs, 0, 0), never read."""
    doc, lo, hi = offs, 0, 0
    if DOCS:
        doc = tl.load(DOC + b * s_docb + offs, mask=ok, other=0)
        lo = tl.min(tl.where(ok, doc, 2147483647), axis=0)
        hi = tl.max(tl.where(ok, doc, lo), axis=0)  # a tile always has an in-range row
    return doc, lo, hi


@triton.jit
def query_rows(QPOS, start, S_q, BLOCK_M: tl.constexpr):
    """Rows start..start+BLOCK_M of the query block: (offs, in-range mask, positions (-1
    out of range), min and max position over the in-range rows)."""
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < S_q
    q_pos = tl.load(QPOS + offs_m, mask=m_ok, other=-1)  # (BLOCK_M,)
    q_min = tl.min(tl.where(m_ok, q_pos, 2147483647), axis=0)
    return offs_m, m_ok, q_pos, q_min, tl.max(q_pos, axis=0)


@triton.jit
def key_rows(KPOS, start, S_k, BLOCK_N: tl.constexpr):
    """Rows start..start+BLOCK_N of the key block: (offs, in-range mask, positions (INT32_MAX
    out of range, so never visible))."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < S_k
    return offs_n, n_ok, tl.load(KPOS + offs_n, mask=n_ok, other=2147483647)  # (BLOCK_N,)


@triton.jit
def tile_live(q_min, q_max, k_pos, n_ok, kv_limit, window, q_dlo, q_dhi, k_dlo, k_dhi,
              CAUSAL: tl.constexpr, DOCS: tl.constexpr):
    """Whether a (query tile, key tile) pair may hold a visible pair, from position bounds and,
    with DOCS, document-id bounds ([q_dlo, q_dhi] and [k_dlo, k_dhi] must meet)."""
    k_min = tl.min(k_pos, axis=0)  # out-of-range keys hold INT32_MAX
    k_max = tl.max(tl.where(n_ok, k_pos, -1), axis=0)
    live = (k_min < kv_limit) & (q_min - k_max < window)
    if CAUSAL:
        live = live & (k_min <= q_max)
    if DOCS:
        live = live & (k_dhi >= q_dlo) & (k_dlo <= q_dhi)
    return live


@triton.jit
def mod_positions(q_pos, k_pos, kv_limit):
    """(q_idx (BLOCK_M, 1), kv_idx (1, BLOCK_N)): the positions the mods see, padding (>= kv_limit) read
    as the last real position, as on the CPU path (cp_compile.ring.masking.mod_positions)."""
    return tl.minimum(q_pos, kv_limit - 1)[:, None], tl.minimum(k_pos, kv_limit - 1)[None, :]


@triton.jit
def mask_tile(visible, b, h, q_pos, k_pos, kv_limit, BUF0, BUF1, BUF2, BUF3, MASK_MOD: tl.constexpr):
    """``visible`` AND the generated mask_mod (:mod:`.mods`) at global positions, if there is one."""
    if MASK_MOD is not None:
        q_idx, kv_idx = mod_positions(q_pos, k_pos, kv_limit)
        visible = visible & MASK_MOD(b, h, q_idx, kv_idx, BUF0, BUF1, BUF2, BUF3)
    return visible


@triton.jit
def _fold_tile(acc, m_i, l_i, q, k, v, q_pos, k_pos, kv_limit, window, q_doc, k_doc, scale, b, h,
               BUF0, BUF1, BUF2, BUF3, CAUSAL: tl.constexpr, DOCS: tl.constexpr, MASK_MOD: tl.constexpr,
               SCORE_MOD: tl.constexpr, INTERP: tl.constexpr):
    """The online-softmax update of (acc (BLOCK_M, BLOCK_D), m, l (BLOCK_M,)) by one key tile."""
    t = dot(q, tl.trans(k), INTERP) * scale  # (BLOCK_M, BLOCK_N) fp32 logits
    visible = visible_pairs(q_pos, k_pos, kv_limit, window, q_doc, k_doc, CAUSAL, DOCS)
    visible = mask_tile(visible, b, h, q_pos, k_pos, kv_limit, BUF0, BUF1, BUF2, BUF3, MASK_MOD)
    if SCORE_MOD is not None:
        q_idx, kv_idx = mod_positions(q_pos, k_pos, kv_limit)
        t = SCORE_MOD(t, b, h, q_idx, kv_idx, BUF0, BUF1, BUF2, BUF3)
    t = tl.where(visible, t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows still keyless: no -inf - -inf
    p = tl.exp(t - m_ref[:, None])  # masked -> 0
    alpha = tl.exp(m_i - m_ref)
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERP), v, INTERP)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _fwd_step(
    Q, K, V, ACC, M, L, QPOS, KPOS, QDOC, KDOC, COUNTER, BUF0, BUF1, BUF2, BUF3,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_qdoc, s_kdoc,
    H, S_q, S_k, D, kv_limit, window, scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr, INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_MOD: tl.constexpr = None, SCORE_MOD: tl.constexpr = None,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)  # b * H + h
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m, m_ok, q_pos, q_min, q_max = query_rows(QPOS, pid_m * BLOCK_M, S_q, BLOCK_M)
    q_doc, q_dlo, q_dhi = doc_rows(QDOC, b, s_qdoc, offs_m, m_ok, DOCS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    row = pid_bh * S_q + offs_m  # row index into the contiguous (B*H*S_q) state
    m_i = tl.load(M + row, mask=m_ok, other=float("-inf"))  # (BLOCK_M,) running max
    l_i = tl.load(L + row, mask=m_ok, other=0.0)
    acc_ptrs = ACC + row[:, None] * D + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D) fp32
    q = tl.load(
        Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh

    for start_n in range(0, S_k, BLOCK_N):
        offs_n, n_ok, k_pos = key_rows(KPOS, start_n, S_k, BLOCK_N)
        k_doc, k_dlo, k_dhi = doc_rows(KDOC, b, s_kdoc, offs_n, n_ok, DOCS)
        if tile_live(q_min, q_max, k_pos, n_ok, kv_limit, window, q_dlo, q_dhi, k_dlo, k_dhi, CAUSAL, DOCS):
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_mask, other=0.0)
            acc, m_i, l_i = _fold_tile(acc, m_i, l_i, q, k, v, q_pos, k_pos, kv_limit, window, q_doc, k_doc, scale,
                                       b, h, BUF0, BUF1, BUF2, BUF3, CAUSAL, DOCS, MASK_MOD, SCORE_MOD, INTERP)
            if COUNT:
                tl.atomic_add(COUNTER, 1)

    tl.store(M + row, m_i, mask=m_ok)
    tl.store(L + row, l_i, mask=m_ok)
    tl.store(acc_ptrs, acc, mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _finalize(ACC, M, L, OUT, LSE, n_rows, D, INTERP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = acc / l (0 where l == 0), lse = m + log l (-inf where l == 0)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < n_rows
    mask = r_ok[:, None] & (offs_d < D)[None, :]
    m = tl.load(M + rows, mask=r_ok, other=0.0)
    l = tl.load(L + rows, mask=r_ok, other=0.0)
    seen = l > 0.0
    l_safe = tl.where(seen, l, 1.0)
    acc = tl.load(ACC + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    out = acc / l_safe[:, None]
    tl.store(OUT + rows[:, None] * D + offs_d[None, :], cast(out, OUT.dtype.element_ty, INTERP), mask=mask)
    lse = tl.where(seen, m + tl.log(l_safe), float("-inf"))
    tl.store(LSE + rows, lse, mask=r_ok)


_fwd_step_tuned = triton.autotune(FWD_CONFIGS, key=KEY + ["SCORE_MOD"],
                                  restore_value=["ACC", "M", "L", "COUNTER"])(_fwd_step)


class DocArgs(NamedTuple):
    """The document-id arguments of a kernel launch (see :func:`doc_args`)."""

    q: Tensor  # QDOC pointer: (B|1, S_q) int32 contiguous, or a placeholder when ``on`` is False
    k: Tensor  # KDOC pointer: (B|1, S_k) int32 contiguous, or a placeholder
    q_stride: int  # batch stride of QDOC (0: one row of ids for every batch row)
    k_stride: int
    on: bool  # the DOCS constexpr


def _doc_rows(doc: Tensor, name: str, s: int, b: int) -> Tuple[Tensor, int]:
    if doc.dtype != torch.int32:
        raise TypeError(f"cp_compile: the Triton kernels take {name} as int32, got {doc.dtype}. "
                        f"Fix: pass {name}.to(torch.int32) (document ids must fit in int32).")
    if doc.dim() == 1:
        doc = doc.unsqueeze(0)
    if doc.dim() != 2 or doc.shape[0] not in (1, b) or doc.shape[1] != s:
        raise ValueError(f"cp_compile: {name} has shape {tuple(doc.shape)}; the Triton kernels take one "
                         f"document id per row, (B|1, S) = ({b} or 1, {s}). Fix: index the whole (B|1, S) "
                         "document ids by this block's global positions.")
    doc = doc.contiguous()
    return doc, (s if doc.shape[0] > 1 else 0)


def doc_args(q_doc: Optional[Tensor], k_doc: Optional[Tensor], q_pos: Tensor, k_pos: Tensor, b: int) -> DocArgs:
    """Check and lay out the document ids of a step: both given (int32, (B|1, S_q) and (B|1, S_k)) or neither
    (then the position tensors stand in as never-read pointers)."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("cp_compile: the Triton kernels take document ids for both the queries and the keys, "
                         "or for neither. Fix: pass q_doc and k_doc together.")
    if q_doc is None:
        return DocArgs(q_pos, k_pos, 0, 0, False)
    q_doc, q_stride = _doc_rows(q_doc, "q_doc", q_pos.shape[0], b)
    k_doc, k_stride = _doc_rows(k_doc, "k_doc", k_pos.shape[0], b)
    return DocArgs(q_doc, k_doc, q_stride, k_stride, True)


def new_state(q: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The empty running state for queries q (B, H, S_q, D): acc 0, m -inf, l 0 (all fp32)."""
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, H, S_q, D)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, S_q)
    l = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
    return acc, m, l


def forward_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tuple[Tensor, Tensor, Tensor],
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    causal: bool,
    scale: float,
    kv_limit: int = NO_LIMIT,
    window: int = NO_LIMIT,
    counter: Optional[Tensor] = None,
    tiles: Optional[Tiles] = None,
    q_doc: Optional[Tensor] = None,
    k_doc: Optional[Tensor] = None,
    mods: Any = None,
) -> None:
    """Merge ``q`` attending to the block ``k``/``v`` into ``state`` (from :func:`new_state`) in place.

    q: (B, H, S_q, D); k, v: (B, H_kv, S_k, D); q_pos (S_q,), k_pos (S_k,) int32 global
    positions; q_doc (B|1, S_q), k_doc (B|1, S_k) int32 document ids, or both None.
    ``counter`` (int32 (1,)) counts the tiles computed, for tests. ``mods``: FlexAttention mods with
    their buffers (:class:`cp_compile.ring.mods.Mods`), run inside the kernel (:mod:`.mods`).
    """
    acc, m, l = state
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    docs = doc_args(q_doc, k_doc, q_pos, k_pos, b)
    fns, buffers = mod_args(mods, q.device, q_pos)
    grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * h)  # noqa: E731
    args = (
        q, k, v, acc, m, l, q_pos, k_pos, docs.q, docs.k, counter if counter is not None else q_pos, *buffers,
        *q.stride(), *k.stride(), *v.stride(), docs.q_stride, docs.k_stride,
        h, s_q, s_k, d, kv_limit, window, scale,
    )
    consts = dict(GROUP=h // k.shape[1], CAUSAL=causal, DOCS=docs.on, COUNT=counter is not None, INTERP=INTERPRET,
                  BLOCK_D=padded_head_dim(d), MASK_MOD=fns.mask, SCORE_MOD=fns.score)
    fixed = fixed_tiles(tiles)
    if fixed is None:
        _fwd_step_tuned[grid](*args, **consts)
    else:
        _fwd_step[grid](*args, **consts, BLOCK_M=fixed.block_m, BLOCK_N=fixed.block_n)


def finalize(state: Tuple[Tensor, Tensor, Tensor], dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(out (B, H, S_q, D) in ``dtype``, lse (B, H, S_q) float32 natural log) from a running state."""
    acc, m, l = state
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    lse = torch.empty(m.shape, dtype=torch.float32, device=acc.device)
    n_rows, d = m.numel(), acc.shape[-1]
    block_r = 32
    _finalize[(triton.cdiv(n_rows, block_r),)](
        acc, m, l, out, lse, n_rows, d, INTERP=INTERPRET, BLOCK_R=block_r, BLOCK_D=padded_head_dim(d)
    )
    return out, lse
