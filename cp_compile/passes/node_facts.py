"""What the passes learn about one FX node, kept under one ``node.meta`` key.

Every per-node result of cp_compile lives in ``node.meta["cp_compile"]``, a :class:`NodeFacts`,
so a reader of a dumped graph (``CP_COMPILE_DUMP``) or a pass finds them in one place and
no key collides with torch's own (``val``, ``example_value``, ``recompute``, ...)::

    facts(node).region       # the checkpointed / compiled region the node came from
    facts(node).global_val   # the single-device fake value (the node's val is per rank)
    facts(node).ring_call    # on a ring op: the typed description of the call

:func:`facts` creates the record on first use; :func:`peek` reads it without creating one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx

META_KEY = "cp_compile"


@dataclass
class NodeFacts:
    """Per-node results of the passes (all optional: most nodes have none)."""

    region: Optional[Any] = None  # passes.normalize.regions.Region
    global_val: Optional[Any] = None  # the single-device fake value, after repropagate
    ring_call: Optional[Any] = None  # the ring op's typed description (set by the attention rule)


def facts(node: fx.Node) -> NodeFacts:
    """The node's :class:`NodeFacts`, created empty on first use."""
    found = node.meta.get(META_KEY)
    if found is None:
        found = node.meta[META_KEY] = NodeFacts()
    return found


def peek(node: fx.Node) -> Optional[NodeFacts]:
    """The node's :class:`NodeFacts` if a pass recorded any, else None."""
    return node.meta.get(META_KEY)
