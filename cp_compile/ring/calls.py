"""The block-kernel calls of one ring step: the plan's rectangles refined by every masking rule.

:func:`step_calls` lists, for this rank's queries against the visiting block ``src``,
each dense call the loops of :mod:`.loops` make (forward and backward alike), as a
:class:`Call`: which batch rows, query rows and key rows, causal or not, an additive
mask or none, and a score function when a ``score_mod`` applies. Three forms:

* no rule beyond the plan, or only a window / explicit mask: the plan's rectangles,
  each cut by :func:`.masking.segment_call` as before;
* document ids alone (with causal and/or padding): each rectangle split into its
  equal-document sub-rectangles (:func:`.docs.doc_rectangles`), per batch row when the
  rows' documents differ; no mask tensor at all;
* a mask_mod, or documents with a window / explicit mask: one boolean mask per rectangle
  (:func:`.masking.rule_mask`), skipped when nothing is visible;
* a score_mod alone (ALiBi): the plan's rectangles as in the first form, with the score
  function bound to their positions (:class:`BoundScore`), and no mask tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

from ..group import CPGroup
from .documents import DocIndex, doc_rectangles
from .masking import BlockPositions, MaskSpec, mod_positions, rule_mask, segment_call
from .plan import ALL, Segment

Tensor = torch.Tensor


@dataclass(frozen=True)
class Call:
    """One kernel call: ``q[b, :, q_rows]`` attending to the visiting ``k/v[b, :, k_rows]``."""

    b: slice
    q: slice
    k: slice
    causal: bool
    mask: Optional[Tensor] = None  # additive (B|1, H|1, Lq, Lk), -inf where masked
    score: Optional[Callable[[Tensor], Tensor]] = None  # score_mod at this rectangle's positions


def _span(s: slice, c: int) -> Tuple[int, int]:
    r = range(c)[s]
    return r.start, r.stop


def _sub(start: int, a: int, b: int, c: int) -> slice:
    """Rows [start + a, start + b) as a slice, ``ALL`` when that is every row."""
    return ALL if start + a == 0 and start + b == c else slice(start + a, start + b)


def _doc_calls(docs: DocIndex, seg: Segment, pos: BlockPositions, rank: int, src: int, c: int) -> Iterator[Call]:
    """The equal-document sub-rectangles of ``seg``, per batch group of ``docs``."""
    (q0, q1), (k0, k1) = _span(seg.q, c), _span(seg.k, c)
    q_pos, k_pos = pos.cpu(rank)[q0:q1], pos.cpu(src)[k0:k1]
    for g, rows in enumerate(docs.groups):
        for a, b, e, f, causal in doc_rectangles(docs.at(g, q_pos), docs.at(g, k_pos), seg.causal):
            yield Call(rows, _sub(q0, a, b, c), _sub(k0, e, f, c), causal)


class BoundScore:
    """``score_mod`` bound to a rectangle's global positions: ``(B, H, Lq, Lk) scores -> scores``;
    :meth:`rows` binds it to a tile of the rectangle's rows (the score kernel's row tiles).

    With learned score buffers (``mods.learned``), :meth:`with_learned` is the score function of
    (scores, *learned buffers) whose vjp the explicit-scores backward takes, and :meth:`add_grads`
    accumulates the buffers' gradients into the call's :class:`.mods.Mods`."""

    def __init__(self, mods: Any, q_pos: Tensor, k_pos: Tensor) -> None:
        self.mods, self.q_pos, self.k_pos = mods, q_pos, k_pos

    def __call__(self, s: Tensor) -> Tensor:
        return self.mods.scores(s, self.q_pos, self.k_pos)

    @property
    def learned(self) -> bool:
        return bool(getattr(self.mods, "learned", ()))

    def learned_values(self, dtype: torch.dtype) -> Tuple[Tensor, ...]:
        return self.mods.learned_values(dtype)

    def with_learned(self, s: Tensor, *learned: Tensor) -> Tensor:
        return self.mods.scores(s, self.q_pos, self.k_pos, learned)

    def add_grads(self, grads: Tuple[Tensor, ...]) -> None:
        self.mods.add_grads(grads)

    def rows(self, r: slice, keys: int) -> "BoundScore":
        """Bound to the rows ``r`` and the first ``keys`` keys of the rectangle."""
        return BoundScore(self.mods, self.q_pos[r], self.k_pos[:keys])


def _score_fn(spec: MaskSpec, seg: Segment, pos: BlockPositions, rank: int, src: int, valid_len: int):
    """``score_mod`` bound to the rectangle's global positions, or None."""
    if spec.mods is None or spec.mods.score_mod is None:
        return None
    qp, kp = mod_positions(pos, rank, seg.q, valid_len), mod_positions(pos, src, seg.k, valid_len)
    return BoundScore(spec.mods, qp, kp)


def _score_only(spec: MaskSpec) -> bool:
    """Mods with a score_mod and no mask_mod, no documents: rectangles need no boolean mask (the score
    kernel applies causality itself), so none of O(Lq·Lk) is built."""
    return spec.mods is not None and spec.mods.mask_mod is None and spec.doc_ids is None


def step_calls(spec: MaskSpec, docs: Optional[DocIndex], causal: bool, group: CPGroup,
               src: int, c: int, valid_len: int, pos: BlockPositions, dims: Tuple[int, int]) -> Iterator[Call]:
    """Every kernel call of this rank's queries against block ``src`` (see the module docstring).

    ``valid_len`` >= 0: global positions from there on are padding; ``dims``: (B, H) of q. The plan is
    ``pos.segments`` (by layout, or by positions when ``pos`` holds a table).
    """
    for seg in pos.segments(causal, src, valid_len):
        if spec.per_rectangle_mask and not _score_only(spec):
            mask = rule_mask(spec, docs, seg, pos, group.rank, src, dims, valid_len)
            if mask is not None:
                yield Call(ALL, seg.q, seg.k, False, mask, _score_fn(spec, seg, pos, group.rank, src, valid_len))
        elif docs is not None:
            yield from _doc_calls(docs, seg, pos, group.rank, src, c)
        else:
            call = segment_call(spec, seg, pos(group.rank), pos(src)) if spec.active else (seg.causal, None)
            if call is not None:
                yield Call(ALL, seg.q, seg.k, call[0], call[1], _score_fn(spec, seg, pos, group.rank, src, valid_len))
