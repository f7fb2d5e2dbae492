"""The distributed ring attention op: plan, K/V rotation, merge, loops and custom ops.

Public entry: :func:`ring_attention`. Importing this package registers the
``cp_compile::ring_attention_fwd`` / ``_bwd`` custom ops.
"""

from . import ops as _ops  # noqa: F401  (registers the custom ops)
from .api import ring_attention
from .documents import doc_ids_from_cu_seqlens, doc_ids_from_position_ids
from .mods import Mods, lookup, register_mods

__all__ = ["Mods", "doc_ids_from_cu_seqlens", "doc_ids_from_position_ids", "lookup", "register_mods", "ring_attention"]
