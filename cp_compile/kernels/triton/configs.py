"""Launch configurations of the Triton kernels: GPU autotune lists and the interpreter's.

On a GPU every kernel is wrapped in :func:`triton.autotune` with the configs below,
keyed on what changes the best tiling: the padded head dim, the causal and document flags
and the block lengths (a ring run keeps one block length, so each kernel tunes once). The
kernels accumulate in place, so the autotuner restores their accumulators after
each trial (``restore_value``).

Under ``TRITON_INTERPRET=1`` (CPU tests) autotuning would only time numpy, so one
fixed config is used; tests may pass their own tile sizes (``tiles=``) to exercise
partial tiles and tile skipping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Every tl.dot operand tile is at least 16 x 16 (a tensor-core requirement).
MIN_TILE = 16


@dataclass(frozen=True)
class Tiles:
    """Query-rows x key-rows tile of one program."""

    block_m: int
    block_n: int

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n):
            if v < MIN_TILE or v & (v - 1):
                raise ValueError(f"cp_compile: Triton tile sizes must be powers of two >= {MIN_TILE}, got {v}.")


# One config for the interpreter: big enough to keep the number of (slow, Python)
# programs small at test shapes, small enough to exercise several tiles per block.
INTERPRETER_TILES = Tiles(32, 32)

KEY = ["S_q", "S_k", "BLOCK_D", "CAUSAL", "DOCS", "MASK_MOD"]  # + SCORE_MOD (forward) / SCORE_GRAD (backward)


def _configs(pairs, warps, stages) -> List[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n in pairs
        for w in warps
        for s in stages
    ]


# Forward / dQ: a program owns BLOCK_M query rows and streams key tiles.
FWD_CONFIGS = _configs([(128, 64), (128, 32), (64, 64), (64, 32)], warps=(4, 8), stages=(2, 3, 4))
# dK/dV: a program owns BLOCK_N key rows and streams query tiles (and the query
# heads of its GQA group), so the key tile is the large one.
BWD_KV_CONFIGS = _configs([(32, 128), (64, 128), (32, 64), (64, 64)], warps=(4, 8), stages=(2, 3))
BWD_Q_CONFIGS = _configs([(128, 32), (64, 64), (64, 32)], warps=(4, 8), stages=(2, 3))


def padded_head_dim(d: int) -> int:
    """The constexpr head dim: next power of two, at least 16 (extra lanes are masked)."""
    return max(MIN_TILE, triton.next_power_of_2(d))


def fixed_tiles(tiles: Optional[Tiles]) -> Optional[Tiles]:
    """The tiles to launch with directly, or None to autotune (GPU without an override)."""
    if tiles is not None:
        return tiles
    return INTERPRETER_TILES if INTERPRET else None
