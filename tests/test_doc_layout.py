"""The document-aware layout (cp_compile.document_layout) and its work model; pure, single process.

- the layout is a partition of range(S) with S/N sorted positions per rank, for random
  packings (tiny documents, one document longer than S/N, S not a multiple of 2N, ...);
- one document gives exactly global zig-zag;
- the work model (per-rank pairs, per-(rank, step) pairs, per-(rank, step) tile cost)
  equals a brute-force count over the full S x S document-causal mask;
- on a realistic packing the model predicts busiest / idlest <= 1.05 for the
  document-aware layout where global zig-zag is far off (asserted from the model,
  never from timing).
"""

from __future__ import annotations

import math
import random
from typing import List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_compile.document_layout import (
    MIN_CHUNKS,
    document_positions,
    imbalance,
    lengths_from_doc_ids,
    rank_work,
    step_pairs,
    step_tiles,
    sync_makespan,
    token_work,
    zigzag_layout,
)
from cp_compile.sequence import rank_positions


def lognormal_packing(seq_len: int, seed: int, mean: float = 2048.0, sigma: float = 1.0) -> List[int]:
    """Document lengths ~ log-normal (mean ``mean``) packed into ``seq_len`` tokens, the last one cut."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma**2 / 2
    out: List[int] = []
    while sum(out) < seq_len:
        out.append(min(max(1, round(rng.lognormvariate(mu, sigma))), seq_len - sum(out)))
    return out


def assert_partition(layout, seq_len: int, world: int) -> None:
    """Equal counts, each rank sorted increasing, together exactly range(S)."""
    assert len(layout) == world
    for pos in layout:
        assert pos.dtype == torch.int64 and pos.shape == (seq_len // world,)
        assert bool((pos[1:] > pos[:-1]).all()), "positions must be strictly increasing"
    assert torch.equal(torch.sort(torch.cat(layout))[0], torch.arange(seq_len))


def doc_mask(lengths: List[int]) -> torch.Tensor:
    """(S, S) bool brute force: query q sees key k iff same document and k <= q."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    s = doc.numel()
    return (doc[:, None] == doc[None, :]) & (torch.arange(s)[None, :] <= torch.arange(s)[:, None])


@st.composite
def packings(draw):
    """(document lengths, N): lengths padded so that S divides by N (often not by 2N)."""
    world = draw(st.sampled_from([2, 3, 4, 8]))
    kind = draw(st.sampled_from(["mixed", "tiny", "one_long"]))
    hi = {"mixed": 300, "tiny": 3, "one_long": 40}[kind]
    lengths = draw(st.lists(st.integers(0, hi), min_size=1, max_size=40))
    if kind == "one_long":  # one document longer than a rank's share
        lengths.insert(draw(st.integers(0, len(lengths))), sum(lengths) + draw(st.integers(1, 200)))
    short = (-sum(lengths)) % world
    lengths.append(short if short or sum(lengths) else world)  # pad: S a positive multiple of N
    return lengths, world


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(packings(), st.sampled_from([None, 1, 4, 64]))
def test_partition_equal_counts_sorted(packing, min_chunk):
    lengths, world = packing
    layout = document_positions(lengths, world, min_chunk=min_chunk)
    assert_partition(layout, sum(lengths), world)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_single_document_is_global_zigzag(world, chunk):
    seq_len = 2 * world * chunk
    layout = document_positions([seq_len], world)
    for r in range(world):
        assert torch.equal(layout[r], rank_positions(seq_len, world, r, "zigzag"))
    assert imbalance(rank_work([seq_len], layout)) == imbalance(rank_work([seq_len], zigzag_layout(seq_len, world)))


@pytest.mark.parametrize("seq_len,world", [(4 * 33, 4), (8 * 101, 8), (3 * 77, 3), (8 * 1001, 8)])
def test_single_document_not_multiple_of_2n(seq_len, world):
    """S a multiple of N only (zig-zag cannot split it): still a partition, and balanced up to one
    token's move per rank (a relative step of about 2N / S)."""
    layout = document_positions([seq_len], world)
    assert_partition(layout, seq_len, world)
    assert imbalance(rank_work([seq_len], layout)) <= 1 + 8 * world / seq_len


def test_tiny_documents_and_one_rank():
    lengths = [1, 2, 1, 3] * 50 + [2]  # 352 tokens
    layout = document_positions(lengths, 4)
    assert_partition(layout, sum(lengths), 4)
    assert imbalance(rank_work(lengths, layout)) <= 1.05
    assert torch.equal(document_positions([5, 0, 7], 1)[0], torch.arange(12))


def test_zero_length_documents_are_ignored():
    layout = document_positions([0, 64, 0, 64, 0], 4)
    assert_partition(layout, 128, 4)


@pytest.mark.parametrize("lengths,world,needle", [
    ([5, 6], 4, "multiple of 4"), ([3, -1, 2], 2, "negative"), ([0, 0], 2, "multiple of 2")])
def test_bad_input_names_the_fix(lengths, world, needle):
    with pytest.raises(ValueError, match="Fix:") as info:
        document_positions(lengths, world)
    assert needle in str(info.value)


def _random_layout(seq_len: int, world: int, gen: torch.Generator):
    perm = torch.randperm(seq_len, generator=gen)
    c = seq_len // world
    return [torch.sort(perm[r * c:(r + 1) * c])[0] for r in range(world)]


@pytest.mark.parametrize("seed", range(6))
def test_work_model_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    world = [2, 3, 4][seed % 3]
    lengths = [int(x) for x in torch.randint(1, 30, (8,), generator=gen)]
    lengths.append(world - sum(lengths) % world)
    seq_len = sum(lengths)
    mask = doc_mask(lengths)  # (S, S)
    assert torch.equal(token_work(lengths), mask.sum(1))
    for layout in (document_positions(lengths, world, min_chunk=2), _random_layout(seq_len, world, gen)):
        steps = step_pairs(lengths, layout)
        for r in range(world):
            for t in range(world):
                assert int(steps[r, t]) == int(mask[layout[r]][:, layout[(r - t) % world]].sum())
        assert steps.sum(1).tolist() == rank_work(lengths, layout)
        assert sync_makespan(steps) == sum(int(steps[:, t].max()) for t in range(world))


def _brute_tiles(block: torch.Tensor, bm: int, bn: int) -> int:
    """Area of the bm x bn tiles of ``block`` (Lq, Lk) holding any True (partial tiles count their size)."""
    area = 0
    for i in range(0, block.shape[0], bm):
        for j in range(0, block.shape[1], bn):
            tile = block[i:i + bm, j:j + bn]
            area += tile.numel() if bool(tile.any()) else 0
    return area


@pytest.mark.parametrize("seed,bm,bn", [(0, 4, 2), (1, 3, 5), (2, 8, 8), (3, 1, 1)])
def test_tile_model_matches_brute_force(seed, bm, bn):
    gen = torch.Generator().manual_seed(seed)
    world = 3
    lengths = [int(x) for x in torch.randint(1, 25, (7,), generator=gen)]
    lengths.append(world - sum(lengths) % world)
    mask = doc_mask(lengths)
    for layout in (document_positions(lengths, world, min_chunk=1), _random_layout(sum(lengths), world, gen)):
        tiles = step_tiles(lengths, layout, bm, bn)
        for r in range(world):
            for t in range(world):
                block = mask[layout[r]][:, layout[(r - t) % world]]
                assert int(tiles[r, t]) == _brute_tiles(block, bm, bn)
    if bm == bn == 1:  # 1 x 1 tiles: exactly the visible pairs
        assert torch.equal(tiles, step_pairs(lengths, layout))


@pytest.mark.slow
@pytest.mark.parametrize("seq_len,world", [(16384, 4), (32768, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_realistic_packing_is_balanced(seq_len, world, seed):
    """Log-normal documents (mean 2k, sigma 1): the model says <= 1.05 busiest / idlest for the
    document-aware layout, per rank and per synchronous ring step, where global zig-zag is worse."""
    lengths = lognormal_packing(seq_len, seed)
    layout = document_positions(lengths, world)
    assert_partition(layout, seq_len, world)
    steps = step_pairs(lengths, layout)
    assert imbalance(steps.sum(1).tolist()) <= 1.05
    assert sync_makespan(steps) <= 1.05 * float(steps.sum()) / world
    zz = step_pairs(lengths, zigzag_layout(seq_len, world))
    assert imbalance(zz.sum(1).tolist()) > 1.05
    assert int(steps.sum(1).max()) < int(zz.sum(1).max())  # the busiest rank has less to do


def test_min_chunk_none_prefers_large_chunks():
    """Auto mode keeps the first (largest) candidate that is balanced: here the largest one."""
    lengths = [8192] * 8  # eight equal long documents: balanced at any chunk size
    auto = document_positions(lengths, 4)
    largest = document_positions(lengths, 4, min_chunk=MIN_CHUNKS[0])
    assert all(torch.equal(a, b) for a, b in zip(auto, largest))


def test_lengths_from_doc_ids():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2, 7, 7, 7, 7]])  # (1, S): ids need not be consecutive numbers
    assert lengths_from_doc_ids(ids) == [3, 1, 2, 4]
    assert lengths_from_doc_ids(ids[0].int()) == [3, 1, 2, 4]
    with pytest.raises(ValueError, match="two separate runs.*Fix:"):
        lengths_from_doc_ids(torch.tensor([0, 0, 1, 0]))
    with pytest.raises(ValueError, match="Fix:"):
        lengths_from_doc_ids(torch.zeros(2, 4, dtype=torch.int64))  # two rows: one packing at a time
