"""Deprecated: moved to :mod:`cp_compile.sequence` (this module re-exports it for one release)."""

import warnings

from cp_compile.sequence import *  # noqa: F401,F403
from cp_compile.sequence import positions, rank_positions, shard, split_multiple, unshard  # noqa: F401

warnings.warn("cp_compile.layout is deprecated: import from cp_compile.sequence instead.", DeprecationWarning, stacklevel=2)
