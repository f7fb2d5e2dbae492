"""The distributed ring attention op: plan, K/V rotation, merge, loops and custom ops.

Public entry: :func:`ring_attention`. Importing this package registers the
``cp_compile::ring_attention_fwd`` / ``_bwd`` custom ops.
"""

from . import ops as _ops  # noqa: F401  (registers the custom ops)
from .api import ring_attention

__all__ = ["ring_attention"]
