"""Deprecated: moved to :mod:`cp_compile.tools.explain` (this module re-exports it for one release)."""

import warnings

from cp_compile.tools.explain import *  # noqa: F401,F403
from cp_compile.tools.explain import InspectError, Report, inspect  # noqa: F401

warnings.warn("cp_compile.inspect_graph is deprecated: import from cp_compile.tools.explain instead.", DeprecationWarning, stacklevel=2)
