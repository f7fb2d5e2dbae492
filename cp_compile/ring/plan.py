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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

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
