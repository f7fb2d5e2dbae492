"""Backward ring-step kernels: one visiting K/V block's exact gradient contributions.

Math (docs/design.md §1). With the *global* (fully merged) output O and log-sum-exp of the
query rows, the probabilities of this block are exact without any other block:
``P = exp(S·scale - lse)`` (masked entries 0). With ``Δ = rowsum(dO ⊙ O)``
(:func:`delta`, once per backward)::

    dV += Pᵀ dO          dS = P ⊙ (dO Vᵀ - Δ)
    dK += scale dSᵀ Q    dQ += scale dS K

Two kernels, each owning its output tile so there are no atomics and the sums are in
a fixed order (bit-reproducible):

* ``_bwd_dkdv``: a program owns BLOCK_N keys of one K/V head and streams the query
  tiles of *every query head of its GQA group*, so dK/dV come out already summed over
  the group. It adds into the fp32 accumulators DK, DV (B, H_kv, S_k, D) that the
  ring sends on to the block's owner.
* ``_bwd_dq``: a program owns BLOCK_M query rows of one head and streams the key
  tiles; it adds into the fp32 DQ (B, H, S_q, D) that stays on this rank.

Masking and tile skipping are the forward's (:mod:`.fwd`): by global positions, with
``kv_limit`` marking padding, ``window`` a sliding window and, with ``DOCS``, document ids
(equal ids only; tiles whose document ranges do not meet are skipped). Rows whose lse is -inf
(saw no key) get P = 0, so no NaN.
With mods (``MASK_MOD``, ``SCORE_GRAD`` from :mod:`.mods`): the forward's mask and tile skipping,
``P = exp(s' - lse)`` with ``s' = score_mod(s)``, and ``dS = P ⊙ (dP - Δ) ⊙ ds'/ds`` (0 where P = 0).
Q, K, V, dO: (B, H(_kv), S, D) any strides; DQ, DK, DV fp32 contiguous; LSE, DELTA
(B, H, S_q) fp32 contiguous; QPOS (S_q,), KPOS (S_k,) int32; QDOC (B|1, S_q), KDOC (B|1, S_k)
int32 (as in :mod:`.fwd`).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import triton
import triton.language as tl

from .configs import BWD_KV_CONFIGS, BWD_Q_CONFIGS, INTERPRET, KEY, Tiles, fixed_tiles, padded_head_dim
from .fwd import (NO_LIMIT, cast, doc_args, doc_rows, dot, key_rows, mask_tile, mod_live, mod_positions, query_rows,
                  tile_live, visible_pairs)
from .mods import mod_args

Tensor = torch.Tensor


@triton.jit
def _probs(q, k, lse, q_pos, k_pos, kv_limit, window, q_doc, k_doc, scale, b, h, BUF0, BUF1, BUF2, BUF3,
           CAUSAL: tl.constexpr, DOCS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
           INTERP: tl.constexpr):
    """(P, dmod) (BLOCK_M, BLOCK_N) fp32 of one tile: P = exp(s' - lse) where visible, else 0, with
    s' = score_mod(scale q·k) (or scale q·k) and dmod = ds'/ds (P again, unused, without a score_mod)."""
    t = dot(q, tl.trans(k), INTERP) * scale
    visible = visible_pairs(q_pos, k_pos, kv_limit, window, q_doc, k_doc, CAUSAL, DOCS)
    visible = mask_tile(visible, b, h, q_pos, k_pos, kv_limit, BUF0, BUF1, BUF2, BUF3, MASK_MOD)
    visible = visible & (lse > float("-inf"))[:, None]
    dmod = t
    if SCORE_GRAD is not None:
        q_idx, kv_idx = mod_positions(q_pos, k_pos, kv_limit)
        t, dmod = SCORE_GRAD(t, b, h, q_idx, kv_idx, BUF0, BUF1, BUF2, BUF3)
    lse_ref = tl.where(lse > float("-inf"), lse, 0.0)
    return tl.exp(tl.where(visible, t - lse_ref[:, None], float("-inf"))), dmod  # masked: exp(-inf) = 0


@triton.jit
def _dscores(p, dmod, dp, delta, SCORE_GRAD: tl.constexpr):
    """dS = P ⊙ (dP - Δ), times ds'/ds with a score_mod (0 where P = 0: no 0 · inf)."""
    ds = p * (dp - delta[:, None])
    if SCORE_GRAD is not None:
        ds = tl.where(p > 0.0, ds * dmod, 0.0)
    return ds


@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, QDOC, KDOC, BUF0, BUF1, BUF2, BUF3,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_ob, s_oh, s_om, s_od,
    s_qdoc, s_kdoc,
    H, S_q, S_k, D, kv_limit, window, scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr, INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_MOD: tl.constexpr = None, SCORE_GRAD: tl.constexpr = None,
):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)  # b * H_kv + hk
    h_kv = H // GROUP
    b = pid_bk // h_kv
    hk = pid_bk % h_kv
    offs_n, n_ok, k_pos = key_rows(KPOS, pid_n * BLOCK_N, S_k, BLOCK_N)
    k_doc, k_dlo, k_dhi = doc_rows(KDOC, b, s_kdoc, offs_n, n_ok, DOCS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k_min = tl.min(k_pos, axis=0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if k_min < kv_limit:
        k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_mask, other=0.0)
        for g in range(GROUP):
            h = hk * GROUP + g
            for start_m in range(0, S_q, BLOCK_M):
                offs_m, m_ok, q_pos, q_min, q_max = query_rows(QPOS, start_m, S_q, BLOCK_M)
                q_doc, q_dlo, q_dhi = doc_rows(QDOC, b, s_qdoc, offs_m, m_ok, DOCS)
                live = tile_live(q_min, q_max, k_pos, n_ok, kv_limit, window, q_dlo, q_dhi, k_dlo, k_dhi, CAUSAL, DOCS)
                if mod_live(live, m_ok, b, h, q_pos, k_pos, kv_limit, window, q_doc, k_doc, BUF0, BUF1, BUF2, BUF3,
                            CAUSAL, DOCS, MASK_MOD):
                    qd_mask = m_ok[:, None] & d_ok[None, :]
                    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                                mask=qd_mask, other=0.0)
                    do = tl.load(DO + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od,
                                 mask=qd_mask, other=0.0)
                    row = (b * H + h) * S_q + offs_m
                    lse = tl.load(LSE + row, mask=m_ok, other=float("-inf"))
                    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
                    p, dmod = _probs(q, k, lse, q_pos, k_pos, kv_limit, window, q_doc, k_doc, scale, b, h, BUF0,
                                     BUF1, BUF2, BUF3, CAUSAL, DOCS, MASK_MOD, SCORE_GRAD, INTERP)  # (BLOCK_M, BLOCK_N)
                    dv += dot(tl.trans(cast(p, do.dtype, INTERP)), do, INTERP)
                    dp = dot(do, tl.trans(v), INTERP)  # (BLOCK_M, BLOCK_N)
                    ds = _dscores(p, dmod, dp, delta, SCORE_GRAD)
                    dk += dot(tl.trans(cast(ds, q.dtype, INTERP)), q, INTERP)
        acc_off = (pid_bk * S_k + offs_n)[:, None] * D + offs_d[None, :]
        tl.store(DK + acc_off, tl.load(DK + acc_off, mask=kv_mask, other=0.0) + dk * scale, mask=kv_mask)
        tl.store(DV + acc_off, tl.load(DV + acc_off, mask=kv_mask, other=0.0) + dv, mask=kv_mask)


@triton.jit
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, QDOC, KDOC, COUNTER, BUF0, BUF1, BUF2, BUF3,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_ob, s_oh, s_om, s_od,
    s_qdoc, s_kdoc,
    H, S_q, S_k, D, kv_limit, window, scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr, INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_MOD: tl.constexpr = None, SCORE_GRAD: tl.constexpr = None,
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
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd, mask=qd_mask, other=0.0)
    do = tl.load(DO + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od, mask=qd_mask, other=0.0)
    row = pid_bh * S_q + offs_m
    lse = tl.load(LSE + row, mask=m_ok, other=float("-inf"))
    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start_n in range(0, S_k, BLOCK_N):
        offs_n, n_ok, k_pos = key_rows(KPOS, start_n, S_k, BLOCK_N)
        k_doc, k_dlo, k_dhi = doc_rows(KDOC, b, s_kdoc, offs_n, n_ok, DOCS)
        live = tile_live(q_min, q_max, k_pos, n_ok, kv_limit, window, q_dlo, q_dhi, k_dlo, k_dhi, CAUSAL, DOCS)
        if mod_live(live, m_ok, b, h, q_pos, k_pos, kv_limit, window, q_doc, k_doc, BUF0, BUF1, BUF2, BUF3,
                    CAUSAL, DOCS, MASK_MOD):
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd,
                        mask=kv_mask, other=0.0)
            v = tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                        mask=kv_mask, other=0.0)
            p, dmod = _probs(q, k, lse, q_pos, k_pos, kv_limit, window, q_doc, k_doc, scale, b, h, BUF0, BUF1, BUF2,
                             BUF3, CAUSAL, DOCS, MASK_MOD, SCORE_GRAD, INTERP)
            dp = dot(do, tl.trans(v), INTERP)
            ds = _dscores(p, dmod, dp, delta, SCORE_GRAD)
            dq += dot(cast(ds, k.dtype, INTERP), k, INTERP)
            if COUNT:
                tl.atomic_add(COUNTER, 1)
    acc_off = row[:, None] * D + offs_d[None, :]
    tl.store(DQ + acc_off, tl.load(DQ + acc_off, mask=qd_mask, other=0.0) + dq * scale, mask=qd_mask)


_bwd_dkdv_tuned = triton.autotune(BWD_KV_CONFIGS, key=KEY + ["SCORE_GRAD"], restore_value=["DK", "DV"])(_bwd_dkdv)
_bwd_dq_tuned = triton.autotune(BWD_Q_CONFIGS, key=KEY + ["SCORE_GRAD"], restore_value=["DQ", "COUNTER"])(_bwd_dq)


def delta(dout: Tensor, out: Tensor) -> Tensor:
    """Δ = rowsum(dO ⊙ O) in fp32: (B, H, S_q, D) x2 -> (B, H, S_q), contiguous."""
    return (dout.float() * out.float()).sum(-1).contiguous()


def backward_step(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    dlt: Tensor,
    grads: Tuple[Tensor, Tensor, Tensor],
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
    """Add this block's (dQ, dK, dV) contributions into ``grads`` = (dq, dk, dv) fp32, in place.

    dout, q: (B, H, S_q, D); k, v: (B, H_kv, S_k, D); lse, dlt: (B, H, S_q) fp32 (global
    lse, :func:`delta`); dq (B, H, S_q, D), dk/dv (B, H_kv, S_k, D) fp32 contiguous; q_doc
    (B|1, S_q), k_doc (B|1, S_k) int32 document ids or both None (:func:`.fwd.forward_step`).
    ``counter`` counts the dQ kernel's computed tiles (tests); ``mods`` as in :func:`.fwd.forward_step`.
    """
    dq, dk, dv = grads
    b, h, s_q, d = q.shape
    h_kv, s_k = k.shape[1], k.shape[2]
    lse = lse.float().contiguous()
    docs = doc_args(q_doc, k_doc, q_pos, k_pos, b)
    fns, buffers = mod_args(mods, q.device, q_pos)
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), docs.q_stride, docs.k_stride,
              h, s_q, s_k, d, kv_limit, window, scale)
    consts = dict(GROUP=h // h_kv, CAUSAL=causal, DOCS=docs.on, INTERP=INTERPRET, BLOCK_D=padded_head_dim(d),
                  MASK_MOD=fns.mask, SCORE_GRAD=fns.score_grad)
    kv_grid = lambda meta: (triton.cdiv(s_k, meta["BLOCK_N"]), b * h_kv)  # noqa: E731
    q_grid = lambda meta: (triton.cdiv(s_q, meta["BLOCK_M"]), b * h)  # noqa: E731
    kv_args = (q, k, v, dout, lse, dlt, dk, dv, q_pos, k_pos, docs.q, docs.k, *buffers, *common)
    q_args = (q, k, v, dout, lse, dlt, dq, q_pos, k_pos, docs.q, docs.k, counter if counter is not None else q_pos,
              *buffers, *common)
    fixed = fixed_tiles(tiles)
    if fixed is None:
        _bwd_dkdv_tuned[kv_grid](*kv_args, **consts)
        _bwd_dq_tuned[q_grid](*q_args, **consts, COUNT=counter is not None)
        return
    tile = dict(BLOCK_M=fixed.block_m, BLOCK_N=fixed.block_n)
    _bwd_dkdv[kv_grid](*kv_args, **consts, **tile)
    _bwd_dq[q_grid](*q_args, **consts, **tile, COUNT=counter is not None)
