"""Layout rules for the complex-number views (RoPE written as complex multiplication).

``torch.view_as_complex`` reads the trailing size-2 dim of a real tensor as (real, imag)
and drops it; ``torch.view_as_real`` adds it back. Both are per element of the other
dims, so the sequence dim keeps its index::

    before: x (B, S, H, D/2, 2) real Sharded(1) -> view_as_complex -> (B, S, H, D/2) complex
    after:  x (B, c, H, D/2, 2) real            -> view_as_complex -> (B, c, H, D/2) complex Sharded(1)

(and the reverse for ``view_as_real``). The multiplication by a complex RoPE table and
``torch.polar`` are ordinary pointwise ops (pointwise.py). Only a sequence dim that *is* the
(real, imag) pair would be split; that never happens with a sequence of 3 or more tokens,
but it is refused (gathered) rather than guessed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...context import global_shape
from ...op_vocab import arguments
from ..placements import Sharded
from .registry import register_rule


@register_rule(torch.view_as_complex, torch.view_as_real)
def complex_view(em, node: fx.Node):
    """``torch.view_as_complex(x)`` / ``torch.view_as_real(x)`` on a Sharded x: same dim."""
    x = arguments(node, ("input",))["input"]
    s = em.layout(x)
    if not isinstance(s, Sharded):
        return em.fallback(node, f"{node.target.__name__} of a value sharded in an unknown way")
    if node.target is torch.view_as_complex and s.dim >= len(global_shape(x)) - 1:
        return em.fallback(node, "view_as_complex merges the sequence dim (the trailing (real, imag) pair)")
    return em.copy(node, *em.value((node.args, node.kwargs))), s

