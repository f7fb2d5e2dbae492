"""Deprecated: the options moved to :mod:`cp_compile.options` (this module re-exports them
for one release)."""

import warnings

from .options import LOAD_BALANCES, ROTATES, RingOptions, check_choice, check_timeout  # noqa: F401

warnings.warn("cp_compile.config is deprecated: import from cp_compile.options instead.", DeprecationWarning,
              stacklevel=2)
