"""The ring step plan (cp_compile.ring.plan) against the ground truth of global positions.

Pure, single process. For every (world size, rank, ring step, layout, causal, local
length) the rectangles returned by ``step_segments`` must cover exactly the (query, key)
pairs a causal / full attention mask allows, each pair once, with no empty rectangles;
and the per-step work must be balanced the way docs/design.md §2 promises.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_compile.sequence import check_seq_len, rank_positions
from cp_compile.ring.plan import Segment, segment_pairs, source_rank, step_segments

LOAD_BALANCES = ("zigzag", "striped", "contiguous")
WORLD_SIZES = range(1, 9)


def local_lengths(load_balance: str):
    """Local lengths c consistent with layout.check_seq_len: even for zigzag (S divides by 2N)."""
    return range(2, 13, 2) if load_balance == "zigzag" else range(1, 13)


@st.composite
def configs(draw):
    lb = draw(st.sampled_from(LOAD_BALANCES))
    n = draw(st.integers(1, 8))
    c = draw(st.sampled_from(list(local_lengths(lb))))
    causal = draw(st.booleans())
    return n, lb, c, causal


@functools.lru_cache(maxsize=None)
def _positions(seq_len: int, n: int, rank: int, lb: str) -> torch.Tensor:
    return rank_positions(seq_len, n, rank, lb)


def allowed_mask(seq_len: int, n: int, rank: int, src: int, lb: str, causal: bool) -> torch.Tensor:
    """The true mask from global positions: queries of ``rank`` x keys of ``src``."""
    q_pos = _positions(seq_len, n, rank, lb)
    k_pos = _positions(seq_len, n, src, lb)
    if not causal:
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    return k_pos[None, :] <= q_pos[:, None]


def segment_rows_cols(seg: Segment, c: int):
    return list(range(c)[seg.q]), list(range(c)[seg.k])


def coverage(segments, c: int) -> torch.Tensor:
    """How many times each local (query, key) pair is computed by ``segments``."""
    count = torch.zeros(c, c, dtype=torch.int64)
    for seg in segments:
        rows, cols = segment_rows_cols(seg, c)
        lq, lk = len(rows), len(cols)
        block = torch.ones(lq, lk, dtype=torch.int64)
        if seg.causal:
            assert lq == lk, f"causal segment {seg} is not square ({lq} x {lk})"
            # top-left aligned: local row i' sees local cols j' <= i'
            block = block.tril()
        count[seg.q, seg.k] += block
    return count


def check_step(n: int, rank: int, step: int, lb: str, c: int, causal: bool) -> None:
    seq_len = n * c
    check_seq_len(seq_len, n, lb)  # the parametrisation itself must be valid
    src = source_rank(rank, step, n)
    assert 0 <= src < n
    segments = step_segments(lb, causal, n, rank, src, c)
    ctx = f"(N={n}, rank={rank}, step={step}, src={src}, lb={lb}, c={c}, causal={causal}, segs={segments})"
    for seg in segments:
        rows, cols = segment_rows_cols(seg, c)
        assert rows and cols, f"empty segment {seg} {ctx}"
        if seg.causal:
            assert len(rows) == len(cols), f"causal segment not square {seg} {ctx}"
        assert segment_pairs(seg, c) > 0, f"segment with no pairs {seg} {ctx}"
    count = coverage(segments, c)
    assert int(count.max()) <= 1, f"pair covered twice {ctx}\n{count}"
    allowed = allowed_mask(seq_len, n, rank, src, lb, causal)
    covered = count > 0
    assert torch.equal(covered, allowed), (
        f"coverage != allowed mask {ctx}\ncovered=\n{covered.int()}\nallowed=\n{allowed.int()}")
    # segment_pairs agrees with the mask it claims to compute
    assert sum(segment_pairs(s, c) for s in segments) == int(allowed.sum()), ctx


# ---------------------------------------------------------------- exact coverage


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(configs())
def test_segments_cover_exactly_the_allowed_mask(cfg):
    n, lb, c, causal = cfg
    for rank in range(n):
        for step in range(n):
            check_step(n, rank, step, lb, c, causal)


@pytest.mark.slow
@pytest.mark.parametrize("lb", LOAD_BALANCES)
def test_segments_cover_allowed_mask_exhaustive(lb):
    """The whole (small) space, so no corner is left to luck: N 1..8, c per layout, both causal."""
    for n in WORLD_SIZES:
        for c in local_lengths(lb):
            for causal in (False, True):
                for rank in range(n):
                    for step in range(n):
                        check_step(n, rank, step, lb, c, causal)


def test_source_rank_is_a_ring():
    for n in WORLD_SIZES:
        for r in range(n):
            assert source_rank(r, 0, n) == r
            # every rank sees every block exactly once over N steps
            assert sorted(source_rank(r, t, n) for t in range(n)) == list(range(n))
            # the block at step t+1 is the one rank r-1 held at step t (received from the left)
            for t in range(n - 1):
                assert source_rank(r, t + 1, n) == source_rank((r - 1) % n, t, n)


def test_striped_single_token_higher_rank_is_empty():
    # c == 1, src > rank: the only key comes after the only query; nothing to compute.
    assert step_segments("striped", True, 4, 0, 3, 1) == ()


def test_unknown_load_balance_raises():
    with pytest.raises(ValueError, match="bogus"):
        step_segments("bogus", True, 2, 1, 0, 4)


# ---------------------------------------------------------------- balance


def step_work(lb: str, causal: bool, n: int, rank: int, step: int, c: int) -> int:
    src = source_rank(rank, step, n)
    return sum(segment_pairs(s, c) for s in step_segments(lb, causal, n, rank, src, c))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), c=st.sampled_from(list(local_lengths("zigzag"))))
def test_zigzag_causal_balanced_every_step(n, c):
    seq_len = n * c
    for step in range(n):
        work = [step_work("zigzag", True, n, r, step, c) for r in range(n)]
        assert len(set(work)) == 1, f"zigzag step {step} unbalanced: {work} (N={n}, c={c})"
    for r in range(n):
        total = sum(step_work("zigzag", True, n, r, t, c) for t in range(n))
        # S(S+1)/2 pairs in total, split evenly over N ranks
        assert total * 2 * n == seq_len * (seq_len + 1), (n, c, r, total)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), c=st.integers(1, 12))
def test_striped_causal_balanced_up_to_diagonal(n, c):
    for step in range(n):
        work = [step_work("striped", True, n, r, step, c) for r in range(n)]
        assert max(work) - min(work) <= c, f"striped step {step}: {work} (N={n}, c={c})"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 8), c=st.integers(1, 12))
def test_contiguous_causal_is_imbalanced(n, c):
    """Documents why zigzag exists: with a contiguous split the last rank does the most work."""
    totals = [sum(step_work("contiguous", True, n, r, t, c) for t in range(n)) for r in range(n)]
    assert totals[-1] > totals[0], totals
    assert totals == sorted(totals)
    # first rank: only its own causal block; last rank: that plus N-1 full blocks
    assert totals[0] == c * (c + 1) // 2
    assert totals[-1] == c * (c + 1) // 2 + (n - 1) * c * c


# ---------------------------------------------------------------- global totals


@settings(max_examples=100, deadline=None)
@given(configs())
def test_every_pair_computed_once_globally(cfg):
    n, lb, c, causal = cfg
    seq_len = n * c
    total = sum(step_work(lb, causal, n, r, t, c) for r in range(n) for t in range(n))
    expected = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    assert total == expected, (n, lb, c, causal, total, expected)


def test_noncausal_padding_keeps_a_prefix_of_the_keys():
    """Padding sits at the end of the sequence, so a block's real keys are a prefix."""
    full = Segment(slice(None), slice(None), False)
    assert step_segments("zigzag", False, 2, 0, 1, 8, valid_keys=8) == (full,)
    assert step_segments("zigzag", False, 2, 0, 1, 8, valid_keys=None) == (full,)
    assert step_segments("zigzag", False, 2, 0, 1, 8, valid_keys=3) == (Segment(slice(None), slice(0, 3), False),)
    assert step_segments("striped", False, 4, 2, 1, 8, valid_keys=0) == ()
    # causal attention never needs it: padding is after every real query
    assert step_segments("zigzag", True, 2, 1, 1, 8, valid_keys=3) == (Segment(slice(None), slice(None), True),)
