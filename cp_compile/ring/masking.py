"""Masks beyond plain causal for the ring: a sliding window, an explicit ``attn_mask``, documents, mods.

All are decided per plan rectangle (:class:`.plan.Segment`) from *global positions*,
so no S x S tensor is ever built for a window, and an explicit mask is only ever
read as this rank's rows x one visiting block's columns.

* ``window = W`` (with causal): key k is visible to query q iff ``0 <= q - k < W``
  (positions), as in Mistral/Gemma sliding-window attention. A rectangle the window
  does not cut runs as planned; one it removes entirely is skipped (so ring steps
  wholly outside the window cost nothing); one it cuts runs with an additive mask of
  that rectangle's size.
* ``attn_mask``: this rank's query rows of the user's mask, ``(B|1, H|1, c, S)``
  with S the global length in global column order; each step indexes the visiting
  block's columns by their positions. A mask that is the same for every query (key
  padding, ``(B|1, H|1, 1, S)``) is broadcast over the rows. The public ``ring_attention`` takes it without
  ``causal`` (as SDPA does); the ``ring_cp`` backend passes both when a model's mask is
  causal (or a window) AND something else, e.g. Hugging Face's causal & key-padding
  mask: then ``attn_mask`` holds only the padding part, (B, 1, 1, S), and causality
  keeps its tile skipping and load balance.

Documents (``doc_ids``) and FlexAttention-style mods (``mask_mod`` / ``score_mod``) are
further rules of :class:`MaskSpec`: documents alone split rectangles without any mask
(:mod:`.docs`, :mod:`.calls`); mods, or documents with a window / explicit mask, get one
boolean mask per rectangle (:func:`rule_mask`).

Block kernels see an additive float mask (0 or -inf); a row with no visible key in
a rectangle gets lse = -inf and out = 0 there (the CPU flash op would say lse = 0),
so the merge ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..group import CPGroup
from ..sequence import rank_positions
from .documents import DocIndex
from .mods import Mods
from .plan import Segment, step_segments, table_segments

Tensor = torch.Tensor
MASKED_BELOW = -1e30  # additive mask values at or below this count as "masked" (HF uses finfo.min)


class BlockPositions:
    """Global positions of every rank's block, computed once per call: ``pos(rank)`` on the
    device (int32, for kernels and mask indexing), ``pos.cpu(rank)`` int64 on the CPU.

    ``table``: (N, c) int64, row r = rank r's sorted positions (a layout computed per batch,
    :func:`cp_compile.sequence.check_table`); it replaces ``load_balance`` and the plan then
    follows the positions (:func:`.plan.table_segments`)."""

    def __init__(self, c: int, group: CPGroup, load_balance: str, device: torch.device,
                 table: Optional[Tensor] = None) -> None:
        self.c, self.group, self.load_balance, self.device = c, group, load_balance, device
        self.table = None if table is None else table.detach().to("cpu", torch.int64)  # (N, c)
        self._cpu: dict = {}
        self._dev: dict = {}

    def cpu(self, rank: int) -> Tensor:
        if rank not in self._cpu:
            self._cpu[rank] = (rank_positions(self.c * self.group.size, self.group.size, rank, self.load_balance)
                               if self.table is None else self.table[rank].contiguous())
        return self._cpu[rank]  # (c,) int64

    def valid_keys(self, rank: int, valid_len: int) -> "int | None":
        """How many of ``rank``'s keys lie before ``valid_len`` (None: no padding, ``valid_len`` < 0)."""
        return None if valid_len < 0 else int((self.cpu(rank) < valid_len).sum())

    def segments(self, causal: bool, src: int, valid_len: int) -> Tuple[Segment, ...]:
        """The plan's rectangles of this rank's queries against block ``src``: by layout, or by
        positions when a table is given."""
        valid, rank = self.valid_keys(src, valid_len), self.group.rank
        if self.table is None:
            return step_segments(self.load_balance, causal, self.group.size, rank, src, self.c, valid)
        return table_segments(causal, rank, src, self.cpu(rank), self.cpu(src), valid)

    def __call__(self, rank: int) -> Tensor:
        if rank not in self._dev:
            self._dev[rank] = self.cpu(rank).to(device=self.device, dtype=torch.int32)
        return self._dev[rank]  # (c,) int32


@dataclass(frozen=True)
class MaskSpec:
    """Every rule of one ring call besides the plan's causality and padding.

    ``window`` (> 0, causal only); ``attn_mask`` (local rows, additive fp32); ``doc_ids``
    (B|1, S) integer document ids over the whole sequence in global order
    (:mod:`.docs`); ``mods``: FlexAttention-style mask_mod / score_mod at global
    positions, with their buffers (:mod:`.mods`). All of them AND together.
    """

    window: int = -1
    attn_mask: Optional[Tensor] = None  # (B|1, H|1, c|1, S) float32, -inf where masked
    doc_ids: Optional[Tensor] = None  # (B|1, S) int32/int64, global position order
    mods: Optional[Mods] = None

    @property
    def active(self) -> bool:
        return self.window > 0 or self.attn_mask is not None or self.doc_ids is not None or self.mods is not None

    @property
    def per_rectangle_mask(self) -> bool:
        """Whether rectangles need the general boolean mask (:func:`rule_mask`): mods, or
        document ids together with a window or an explicit mask."""
        return self.mods is not None or (self.doc_ids is not None and (self.window > 0 or self.attn_mask is not None))


def additive_mask(mask: Tensor) -> Tensor:
    """bool (True = attend) or additive float -> additive float32 with exactly -inf where masked.

    Additive values <= -1e30 (e.g. ``torch.finfo(dtype).min``, which Hugging Face uses)
    become -inf: merged across ring steps in log-sum-exp space, such huge finite
    offsets lose every bit of the scores they are added to, while -inf stays exact.
    """
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    m = mask.float()
    return m.masked_fill(m <= MASKED_BELOW, float("-inf"))


def _window_visible(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """(Lq, Lk) bool: causal sliding window by positions."""
    d = q_pos[:, None] - k_pos[None, :]
    return (d >= 0) & (d < window)


def segment_call(spec: MaskSpec, seg: Segment, q_pos: Tensor, k_pos: Tensor) -> Optional[Tuple[bool, Optional[Tensor]]]:
    """How to run ``seg`` of a step: None (nothing visible: skip it) or (causal, additive mask or None).

    q_pos: (c,) this rank's global positions; k_pos: (c,) the visiting block's. A window
    that cuts the rectangle, or an explicit mask, turns it into one additive mask of the
    rectangle's size; a causal rectangle's causality is folded into that mask by position
    (``k <= q``), so a row whose causally visible keys are all masked is seen as dead
    (:func:`fix_dead_rows`) instead of reaching the kernel as a fully masked row.
    """
    qp, kp = q_pos[seg.q], k_pos[seg.k]
    causal, visible = seg.causal, None  # visible: (Lq, Lk) bool by position, when a window cuts here
    if spec.window > 0 and int(qp.max() - kp.min()) >= spec.window:
        visible, causal = _window_visible(qp, kp, spec.window), False
        if not bool(visible.any()):
            return None
    if spec.attn_mask is None:
        return causal, None if visible is None else additive_mask(visible)
    m = spec.attn_mask  # (B|1, H|1, c|1, S)
    cols = (m if m.shape[-2] == 1 else m[..., seg.q, :]).index_select(-1, kp)
    cols = cols.expand(*cols.shape[:-2], len(qp), len(kp))  # (B|1, H|1, Lq, Lk)
    if causal:
        visible, causal = kp[None, :] <= qp[:, None], False
    if visible is not None:
        cols = cols.masked_fill(~visible, float("-inf"))
    if bool(torch.isneginf(cols).all()):
        return None
    return causal, cols


def mod_positions(pos: BlockPositions, rank: int, rows: slice, valid_len: int) -> Tensor:
    """Global positions of ``rank``'s ``rows`` as the mods see them: padding positions (>= ``valid_len``)
    read as the last real one, so mods indexing buffers of the unpadded length stay in bounds (no real
    query sees a padding key: causality or the plan's cut hides them)."""
    p = pos(rank)[rows]
    return p if valid_len < 0 else p.clamp(max=max(valid_len - 1, 0))


def rule_mask(spec: MaskSpec, docs: Optional[DocIndex], seg: Segment, pos: BlockPositions, rank: int, src: int,
              dims: Tuple[int, int], valid_len: int = -1) -> Optional[Tensor]:
    """One additive mask (B|1, H|1, Lq, Lk) of ``seg`` under every rule of ``spec``, or None when
    nothing in it is visible (the rectangle is skipped). ``dims``: (B, H) of the queries.

    Causality (index-causal in a causal segment, which the plan makes the same as
    ``k <= q`` by position), the window, the documents and ``mask_mod`` are ANDed as
    booleans, then the explicit mask's columns are added. Transient O(B·H·Lq·Lk).
    """
    qp, kp = pos(rank)[seg.q], pos(src)[seg.k]  # (Lq,), (Lk,) int32 on the device
    visible = torch.ones(1, 1, len(qp), len(kp), dtype=torch.bool, device=qp.device)
    if seg.causal:
        visible = visible.tril()
    if spec.window > 0:
        visible = visible & _window_visible(qp, kp, spec.window)
    if docs is not None:
        visible = visible & docs.same_doc(pos.cpu(rank)[seg.q], pos.cpu(src)[seg.k], qp.device)
    if spec.mods is not None and spec.mods.mask_mod is not None:
        mq, mk = mod_positions(pos, rank, seg.q, valid_len), mod_positions(pos, src, seg.k, valid_len)
        visible = visible & spec.mods.mask(dims[0], dims[1], mq, mk)
    if not bool(visible.any()):
        return None
    mask = additive_mask(visible)  # (B|1, H|1, Lq, Lk)
    if spec.attn_mask is not None:
        m = spec.attn_mask  # (B|1, H|1, c|1, S)
        cols = (m if m.shape[-2] == 1 else m[..., seg.q, :]).index_select(-1, kp)  # (B|1, H|1, Lq|1, Lk)
        mask = mask + cols
        if bool(torch.isneginf(mask).all()):
            return None
    return mask


def fix_dead_rows(out: Tensor, lse: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Rows that see no key under ``mask`` (B|1, H|1, Lq, Lk): lse -> -inf, out -> 0."""
    dead = torch.isneginf(mask).all(-1)  # (B|1, H|1, Lq)
    if not bool(dead.any()):
        return out, lse
    return out.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, float("-inf"))


def any_visible(q_pos: Tensor, k_pos: Tensor, window: int) -> bool:
    """Whether some (query, key) pair is within a causal ``window`` (positions increasing)."""
    lo = torch.searchsorted(k_pos, q_pos - window + 1)  # first key inside the window
    hi = torch.searchsorted(k_pos, q_pos, right=True)  # one past the last key <= q
    return bool((hi > lo).any())
