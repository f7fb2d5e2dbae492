"""The layout rules' table: the registry (:mod:`.registry`) once every rule module is imported, and
:func:`apply_rule`, which looks a node's rule up there (without one: the oracle, then the gather).

Each rule is registered where it is defined, with ``@register_rule(*targets)``; the table of the
rules by op class is docs/design.md §6, checked against the registry by tests/test_rules.py.
"""

from __future__ import annotations

import torch.fx as fx

from ..emitter import Emitter
from ..oracle import decide
from ..placements import Sharded
from . import (  # noqa: F401  (imported for their @register_rule)
    assoc_scan, attention, autograd_fn, complex, einsum, fill, flex, getitem, halo, losses, order, pointwise,
    reductions, routing, scans, setitem, views, vmap,
)
from ...analyze.find_recurrences import is_recurrence
from .recurrence import recurrence
from .common import _flat_args, _key, _name
from .registry import CHUNK_AWARE, RULES, WINDOW_AWARE
from .routing import involves_local, local_rule


def apply_rule(em: Emitter, node: fx.Node):
    """Layout and new value of ``node``, which has at least one Sharded or Local input.

    An input that is a window of the sequence (a slice ``h[:, 1:]``: rules/getitem.py) reaches only
    the rules marked ``@window_aware``; for any other op it is gathered (narrowed to its window) and
    the op runs whole, warned: a rule that assumes S rows must never see n. The same for an input
    holding the sequence in chunks (``x.view(B, S // C, C, D)``): only ``@chunk_aware`` rules and, for an
    op with no rule, the oracle (which reads chunks as it reads tokens) see one."""
    if any(em.windowed(a) for a in _flat_args(node)) and RULES.get(_key(node)) not in WINDOW_AWARE:
        return em.fallback(node, f"{_name(node)} of a slice of the sequence (it has no window-aware rule)")
    if any(_chunked(em, a) for a in _flat_args(node)) and RULES.get(_key(node)) not in CHUNK_AWARE \
            and not is_recurrence(node):  # (a recurrence's rule reads chunks: its steps are the chunks)
        decided = decide(em, node) if _key(node) not in RULES else None  # the oracle reads chunks too
        if decided is not None:
            return decided
        return em.fallback(node, f"{_name(node)} of the sequence viewed in chunks (it has no chunk-aware rule)")
    if involves_local(em, node):
        return local_rule(em, node)
    rule = RULES.get(_key(node))
    if rule is None and is_recurrence(node):
        return recurrence(em, node)  # keyed by registration, not by the registry (cp_compile.register_recurrence)
    if rule is None:
        decided = decide(em, node)  # no hand rule: ask the op's ATen decomposition before gathering
        if decided is not None:
            return decided
        return em.fallback(node, f"{_name(node)} is not known to be per-token")
    return rule(em, node)


def _chunked(em: Emitter, arg) -> bool:
    lay = em.layout(arg)
    return isinstance(lay, Sharded) and lay.chunk > 1


__all__ = ["RULES", "apply_rule"]
