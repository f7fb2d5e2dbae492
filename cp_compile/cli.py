"""Deprecated: moved to :mod:`cp_compile.tools.cli` (this module re-exports it for one release)."""

import warnings

from cp_compile.tools.cli import *  # noqa: F401,F403
from cp_compile.tools.cli import main  # noqa: F401

warnings.warn("cp_compile.cli is deprecated: import from cp_compile.tools.cli instead.", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    raise SystemExit(main())
