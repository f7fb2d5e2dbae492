"""Explicit-scores block attention for a ``score_mod``: any device and dtype, fp32 math.

A ``score_mod`` (FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx, ...)``, e.g.
ALiBi or logit soft-capping) changes the scores themselves, which no flash op exposes,
so the ring computes such rectangles here, one (B, H, Lq, Lk) score block at a time
(transient, freed after the call):

* forward: ``s = score(q·kᵀ·scale)`` masked additively -> (out, lse), lse = -inf and
  out = 0 for a row with no visible key;
* backward, with the *global* out and lse: recomputes ``s`` and its vector-Jacobian
  product through ``score`` (``torch.func.vjp``), then
  ``dv = pᵀ dO``, ``dp = dO vᵀ``, ``ds = p (dp - rowsum(dO·O))``, ``dq = vjp(ds) k · scale``,
  ``dk = vjp(ds)ᵀ q · scale``; with learned score buffers the same vjp also gives each
  buffer's gradient, which the score function accumulates (masked pairs carry nothing).

GQA: query head h reads K/V head ``h // (H / H_kv)``, without repeating K/V in memory.
Math runs in fp32 (fp64 for fp64 inputs), so the result is as exact as the reference kernel.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

Tensor = torch.Tensor
ScoreFn = Callable[[Tensor], Tensor]  # (B, H, Lq, Lk) scores -> modified scores, same shape


def _ct(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _raw_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q·kᵀ·scale (B, H, Lq, Lk) in the compute dtype; q (B, H, Lq, D), k (B, H_kv, Lk, D)."""
    b, h, lq, d = q.shape
    h_kv, ct = k.shape[1], _ct(q.dtype)
    qg = q.to(ct).reshape(b, h_kv, h // h_kv, lq, d)  # (B, H_kv, G, Lq, D)
    s = torch.einsum("bngqd,bnkd->bngqk", qg, k.to(ct)) * scale
    return s.reshape(b, h, lq, k.shape[2])


def _masked(s: Tensor, mask: Optional[Tensor], causal: bool, row0: int = 0) -> Tensor:
    """Scores with the additive mask and (index-)causality applied; ``row0``: the rectangle row of
    ``s``'s first row (a row tile)."""
    if mask is not None:
        s = s + mask.to(s.dtype)
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(row0), float("-inf"))
    return s


TILE_ELEMENTS = 1 << 16  # B·H·rows·Lk of one tile of explicit scores (256 KiB fp32); 0: whole rectangles


def _tiles(q: Tensor, k: Tensor, score: ScoreFn) -> List[slice]:
    """Row tiles of a rectangle so that each tile's (B, H, rows, Lk) scores hold at most
    ``TILE_ELEMENTS``: every transient of the kernel is a few such tiles, whatever the rectangle.
    One tile when the score function cannot be cut by rows (it has no ``rows``)."""
    b, h, lq = q.shape[:3]
    rows = max(1, TILE_ELEMENTS // max(1, b * h * k.shape[2])) if TILE_ELEMENTS > 0 and hasattr(score, "rows") else lq
    return [slice(r, min(r + rows, lq)) for r in range(0, lq, rows)]


def _tile_args(r: slice, lk: int, causal: bool, score: ScoreFn, mask: Optional[Tensor]):
    """(keys kept, score fn, mask) of the row tile ``r``: in a causal rectangle the keys after the
    tile's last row are all masked, so they are left out (half the work of a diagonal block)."""
    kc = min(r.stop, lk) if causal else lk
    if mask is not None:
        mask = mask if mask.shape[-2] == 1 else mask[..., r, :]
        mask = mask if mask.shape[-1] == 1 else mask[..., :kc]
    return kc, score.rows(r, kc), mask


def _grouped(x: Tensor, h_kv: int) -> Tensor:
    b, h = x.shape[:2]
    return x.reshape(b, h_kv, h // h_kv, *x.shape[2:])  # (B, H_kv, G, ...)


class ScoresKernel:
    """Block attention with a score function (not a registered kernel: the ring calls it for
    rectangles that have a ``score_mod``, whatever ``kernel=`` says)."""

    name = "scores"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, score: ScoreFn,
                mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(out (B, H, Lq, D), lse (B, H, Lq)) in the compute dtype; ``mask`` additive (B|1, H|1, Lq, Lk).
        Computed in row tiles (:func:`_tiles`); rows are independent, so the result is the same."""
        tiles = _tiles(q, k, score)
        if len(tiles) == 1:
            return self._forward(q, k, v, causal, scale, score, mask, 0)
        ct = _ct(q.dtype)  # each tile written in place: no list of tiles plus their concatenation (2x out)
        out, lse = q.new_empty(q.shape[:3] + v.shape[3:], dtype=ct), q.new_empty(q.shape[:3], dtype=ct)
        for r in tiles:
            kc, fn, m = _tile_args(r, k.shape[2], causal, score, mask)
            out[:, :, r], lse[:, :, r] = self._forward(q[:, :, r], k[:, :, :kc], v[:, :, :kc], causal, scale, fn, m,
                                                       r.start)
        return out, lse

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, score: ScoreFn,
                 mask: Optional[Tensor], row0: int) -> Tuple[Tensor, Tensor]:
        b, h, lq, d = q.shape
        s = _masked(score(_raw_scores(q, k, scale)), mask, causal, row0)  # (B, H, Lq, Lk)
        lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
        safe = lse.masked_fill(torch.isneginf(lse), 0.0)
        p = torch.exp(s - safe.unsqueeze(-1))  # rows with no key: exp(-inf) = 0
        out = torch.einsum("bngqk,bnkd->bngqd", _grouped(p, k.shape[1]), v.to(p.dtype))
        return out.reshape(b, h, lq, d), lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                 causal: bool, scale: float, score: ScoreFn, mask: Optional[Tensor] = None,
                 dq_acc: Optional[Tensor] = None) -> Tuple[Optional[Tensor], Tensor, Tensor]:
        """(dq, dk, dv) of this block given the global ``out`` and ``lse`` (B, H, Lq), in row tiles:
        dq written per tile, dk and dv accumulated in place over the tiles (no per-tile
        (B, H_kv, Lk, D) partials: they were the largest transients of the kernel). With ``dq_acc``
        (B, H, Lq, D) in the compute dtype, e.g. a view of the ring's dQ accumulator, each tile's dq
        is added into it in place instead (no (B, H, Lq, D) block result) and dq is returned as None."""
        ct = _ct(q.dtype)
        dq = q.new_empty(q.shape, dtype=ct) if dq_acc is None else dq_acc  # (B, H, Lq, D)
        dk, dv = k.new_zeros(k.shape, dtype=ct), v.new_zeros(v.shape, dtype=ct)  # (B, H_kv, Lk, D)
        tiles = _tiles(q, k, score)
        for r in tiles:
            kc, fn, m = _tile_args(r, k.shape[2], causal, score, mask) if len(tiles) > 1 else (k.shape[2], score, mask)
            dq_r = self._backward(dout[:, :, r], q[:, :, r], k[:, :, :kc], v[:, :, :kc], out[:, :, r],
                                  lse[:, :, r], causal, scale, fn, m, r.start, dk[:, :, :kc], dv[:, :, :kc])
            if dq_acc is None:
                dq[:, :, r] = dq_r
            else:
                dq[:, :, r] += dq_r
        return (dq if dq_acc is None else None), dk, dv

    def _backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, score: ScoreFn, mask: Optional[Tensor], row0: int, dk: Tensor, dv: Tensor) -> Tensor:
        """dq of one row tile; adds the tile's share of dK and dV into ``dk`` and ``dv`` (views of the
        block's accumulators, (B, H_kv, Lk, D) in the compute dtype)."""
        h_kv = k.shape[1]
        raw = _raw_scores(q, k, scale)
        ct = raw.dtype
        s_mod, vjp = _score_vjp(score, raw)
        s = _masked(s_mod, mask, causal, row0)  # (B, H, Lq, Lk)
        lse = lse.to(ct)
        p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))  # global probabilities
        do, o = dout.to(ct), out.to(ct)
        _add_grouped_t(dv, p, do)  # dv += pᵀ dO
        dp = torch.einsum("bngqd,bnkd->bngqk", _grouped(do, h_kv), v.to(ct)).reshape(p.shape)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))  # d loss / d (modified score)
        masked = torch.isneginf(s)
        ds_raw = vjp(ds.masked_fill(masked, 0.0))
        # masked pairs carry nothing, even where score' is inf
        ds_raw = ds_raw.masked_fill(masked, 0.0) * scale
        _add_grouped_t(dk, ds_raw, q.to(ct))  # dk += ds_rawᵀ q
        return torch.einsum("bngqk,bnkd->bngqd", _grouped(ds_raw, h_kv), k.to(ct)).reshape(q.shape)


def _score_vjp(score: ScoreFn, raw: Tensor) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(score(raw), ds -> d loss / d raw). A score function with learned buffers (``score.learned``,
    :class:`cp_compile.ring.calls.BoundScore`) is differentiated with respect to them too, and each call of
    the returned function adds their gradients into the score's accumulators (``score.add_grads``)."""
    if not getattr(score, "learned", False):
        s_mod, vjp = torch.func.vjp(score, raw)
        return s_mod, lambda ds: vjp(ds)[0]
    s_mod, vjp = torch.func.vjp(score.with_learned, raw, *score.learned_values(raw.dtype))

    def back(ds: Tensor) -> Tensor:
        ds_raw, *d_learned = vjp(ds)
        score.add_grads(tuple(d_learned))
        return ds_raw

    return s_mod, back


def _add_grouped_t(acc: Tensor, a: Tensor, x: Tensor) -> None:
    """acc[b, n] += Σ_g a[b, (n, g)]ᵀ x[b, (n, g)] in place: acc (B, H_kv, Lk, D) (a view with unit
    last stride), a (B, H, Lq, Lk), x (B, H, Lq, D); the query heads of a K/V head are summed
    by one batched matmul over (g, q) rows, with no (B, H_kv, Lk, D) temporary."""
    b, h_kv, lk, d = acc.shape
    rows = a.shape[1] // h_kv * a.shape[2]  # G·Lq
    a3 = a.reshape(b * h_kv, rows, lk)  # (B·H_kv, G·Lq, Lk)
    x3 = x.reshape(b * h_kv, rows, d)  # (B·H_kv, G·Lq, D)
    acc.view(b * h_kv, lk, d).baddbmm_(a3.transpose(1, 2), x3)


SCORES = ScoresKernel()
