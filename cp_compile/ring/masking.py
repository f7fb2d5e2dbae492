"""Masks beyond plain causal for the ring: a sliding window and an explicit ``attn_mask``.

Both are decided per plan rectangle (:class:`.plan.Segment`) from *global positions*,
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
from .plan import Segment

Tensor = torch.Tensor
MASKED_BELOW = -1e30  # additive mask values at or below this count as "masked" (HF uses finfo.min)


class BlockPositions:
    """Global positions of every rank's block, computed once per call: ``pos(rank)`` on the
    device (int32, for kernels and mask indexing), ``pos.cpu(rank)`` int64 on the CPU."""

    def __init__(self, c: int, group: CPGroup, load_balance: str, device: torch.device) -> None:
        self.c, self.group, self.load_balance, self.device = c, group, load_balance, device
        self._cpu: dict = {}
        self._dev: dict = {}

    def cpu(self, rank: int) -> Tensor:
        if rank not in self._cpu:
            self._cpu[rank] = rank_positions(self.c * self.group.size, self.group.size, rank, self.load_balance)
        return self._cpu[rank]  # (c,) int64

    def valid_keys(self, rank: int, valid_len: int) -> "int | None":
        """How many of ``rank``'s keys lie before ``valid_len`` (None: no padding, ``valid_len`` < 0)."""
        return None if valid_len < 0 else int((self.cpu(rank) < valid_len).sum())

    def __call__(self, rank: int) -> Tensor:
        if rank not in self._dev:
            self._dev[rank] = self.cpu(rank).to(device=self.device, dtype=torch.int32)
        return self._dev[rank]  # (c,) int32


@dataclass(frozen=True)
class MaskSpec:
    """``window`` (> 0, causal only) or ``attn_mask`` (local rows, additive fp32), or neither."""

    window: int = -1
    attn_mask: Optional[Tensor] = None  # (B|1, H|1, c|1, S) float32, -inf where masked

    @property
    def active(self) -> bool:
        return self.window > 0 or self.attn_mask is not None


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
