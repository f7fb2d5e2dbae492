"""What the passes learn about one FX node, kept under one ``node.meta`` key.

Every per-node result of cp_compile lives in ``node.meta["cp_compile"]``, a :class:`NodeFacts`,
so a reader of a dumped graph (``CP_COMPILE_DUMP``) or a pass finds them in one place and
no key collides with torch's own (``val``, ``example_value``, ``recompute``, ...)::

    facts(node).region       # the checkpointed / compiled region the node came from
    facts(node).flex         # on a flex_attention node: its parsed mods and buffers
    facts(node).unfused      # on a softmax of attention that could not become SDPA: why
    facts(node).global_val   # the single-device fake value (the node's val is per rank)
    facts(node).ring_call    # on a ring op: the typed description of the call

The record is frozen and replaced on every update (:func:`set_facts`): FX copies a node's
meta shallowly (``Graph.node_copy``), so an updated copy must not write through to the node
it was copied from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch.fx as fx

META_KEY = "cp_compile"


@dataclass(frozen=True)
class NodeFacts:
    """Per-node results of the passes (all optional: most nodes have none)."""

    region: Optional[Any] = None  # passes.normalize.regions.Region
    flex: Optional[Any] = None  # on a flex_attention node: its parsed passes.analyze.find_flex.FlexSpec
    unfused: Optional[str] = None  # on a softmax fuse_attention matched but could not turn into SDPA: why
    global_val: Optional[Any] = None  # the single-device fake value, after repropagate
    ring_call: Optional[Any] = None  # the ring op's typed description (set by the attention rule)


_EMPTY = NodeFacts()


def facts(node: fx.Node) -> NodeFacts:
    """The node's :class:`NodeFacts` (an empty one when no pass recorded any)."""
    return node.meta.get(META_KEY, _EMPTY)


def set_facts(node: fx.Node, **fields: Any) -> NodeFacts:
    """Record ``fields`` on ``node`` (a new record: copies of the node keep theirs)."""
    new = replace(facts(node), **fields)
    node.meta[META_KEY] = new
    return new
