"""Which rectangles of a ring step are computed: the causal rules per layout, in one table.

At ring step t, rank r holds the K/V block of rank ``src = (r - t) mod N``. Both
blocks list their tokens in increasing global order (see :mod:`cp_compile.sequence`),
each of ``c`` tokens. A step is a tuple of :class:`Segment` s: dense rectangles
(query rows x key rows), each either unmasked or causal with Lq == Lk (query i sees
keys 0..i). Fully masked rectangles are never listed, so the kernels never see an
empty block or a fully masked row.

| causal | layout     | src == r      | src < r                        | src > r                              |
|--------|------------|---------------|--------------------------------|--------------------------------------|
| no     | any        | all x all     | all x all                      | all x all                            |
| yes    | any        | causal all    | (by layout, below)             | (by layout, below)                   |
| yes    | contiguous |               | all x all                      | nothing                              |
| yes    | zigzag     |               | all x first half (h = c/2)     | second half x all                    |
| yes    | striped    |               | causal all (diagonal included) | causal q[1:] x k[:-1] (diag excluded)|

Why zigzag: rank r holds chunks r and 2N-1-r. A lower rank's first chunk precedes
both local chunks and its second chunk follows both; a higher rank's two chunks both
follow local chunk r and precede local chunk 2N-1-r. Why striped: query j of rank r
is token r + jN, key m of rank s is token s + mN, so m <= j when s <= r and
m <= j - 1 when s > r.

A layout given as a table of positions (one sorted row per rank, computed per batch,
e.g. :func:`cp_compile.document_layout.layout_table`) is planned from the positions
themselves (:func:`table_segments`): causally, query row i of another rank's block sees
exactly the key prefix [0, hi_i), hi = searchsorted(k_pos, q_pos, right=True), which
never decreases (rows sorted). Rows where hi is constant form one full rectangle; rows
where it grows by one per row form a staircase (a causal square, plus a full block left
of it). On the three fixed layouts this gives the table above exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

ALL = slice(None)


@dataclass(frozen=True)
class Segment:
    """One dense rectangle of a step: query rows ``q`` x key rows ``k``, optionally causal."""

    q: slice
    k: slice
    causal: bool


def source_rank(rank: int, step: int, world_size: int) -> int:
    """Whose K/V block ``rank`` holds at ring ``step``."""
    return (rank - step) % world_size


def step_segments(
    load_balance: str,
    causal: bool,
    world_size: int,
    rank: int,
    src: int,
    local_len: int,
    valid_keys: Optional[int] = None,
) -> Tuple[Segment, ...]:
    """The rectangles rank ``rank`` computes against the block of rank ``src`` (table above).

    ``valid_keys``: how many of the block's keys are real tokens rather than padding
    (a padded sequence puts its padding at the end, so the valid keys of every block
    are a prefix). Only non-causal attention needs it: causally, padding at the end
    is never visible to a real query.
    """
    if not causal:
        if valid_keys is None or valid_keys >= local_len:
            return (Segment(ALL, ALL, False),)
        return (Segment(ALL, slice(0, valid_keys), False),) if valid_keys > 0 else ()
    if src == rank:
        return (Segment(ALL, ALL, True),)
    lower = src < rank
    if load_balance == "contiguous":
        return (Segment(ALL, ALL, False),) if lower else ()
    if load_balance == "zigzag":
        h = local_len // 2
        return (Segment(ALL, slice(0, h), False),) if lower else (Segment(slice(h, None), ALL, False),)
    if load_balance == "striped":
        if lower:
            return (Segment(ALL, ALL, True),)
        if local_len == 1:
            return ()
        return (Segment(slice(1, None), slice(0, local_len - 1), True),)
    raise ValueError(f"cp_compile: unknown load_balance {load_balance!r}.")


def segment_pairs(seg: Segment, local_len: int) -> int:
    """Number of unmasked (query, key) pairs ``seg`` computes (for balance checks and FLOP counts)."""
    lq = len(range(local_len)[seg.q])
    lk = len(range(local_len)[seg.k])
    return lq * (lq + 1) // 2 if seg.causal else lq * lk


def _rows(start: int, stop: int, c: int) -> slice:
    """Rows (or keys) [start, stop) of a block of ``c`` as a slice, in the fixed plans' spelling."""
    if start == 0:
        return ALL if stop >= c else slice(0, stop)
    return slice(start, None) if stop >= c else slice(start, stop)


def _runs(hi: List[int]) -> List[Tuple[int, int, bool]]:
    """Rows split into runs (start, stop, staircase): hi constant over a flat run, +1 per row over a
    staircase. Greedy from the top; a row that fits neither with its successor is a run of its own."""
    runs, a, c = [], 0, len(hi)
    while a < c:
        b = a + 1
        if b < c and hi[b] - hi[a] in (0, 1):
            step = hi[b] - hi[a]
            while b < c and hi[b] - hi[b - 1] == step:
                b += 1
            runs.append((a, b, step == 1))
        else:
            runs.append((a, b, False))
        a = b
    return runs


def table_segments(causal: bool, rank: int, src: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   valid_keys: Optional[int] = None) -> Tuple[Segment, ...]:
    """The rectangles of a step planned from positions (module docstring), for a layout given as a table.

    q_pos: (c,) this rank's sorted global positions; k_pos: (c,) block ``src``'s. Non-causal and the
    diagonal step (``src == rank``, same positions) are planned as in :func:`step_segments`.
    """
    c = len(q_pos)
    if not causal or src == rank:
        return step_segments("contiguous", causal, 1, 0, 0, c, valid_keys)
    hi = torch.searchsorted(k_pos, q_pos, right=True).tolist()  # (c,) keys [0, hi_i) visible to row i
    segs: List[Segment] = []
    for a, b, stair in _runs(hi):
        if stair and hi[a] == 0:  # the staircase's first row sees nothing
            a += 1
        if a >= b or hi[a] == 0:
            continue
        if not stair:
            segs.append(Segment(_rows(a, b, c), _rows(0, hi[a], c), False))
            continue
        e = hi[a] - 1  # row a sees keys [0, e] : a full block [0, e), then the causal square from e
        if e > 0:
            segs.append(Segment(_rows(a, b, c), _rows(0, e, c), False))
        segs.append(Segment(_rows(a, b, c), _rows(e, e + b - a, c), True))
    return tuple(segs)
