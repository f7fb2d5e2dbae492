"""The :class:`cp_compile.ring.call_spec.RingCall` of a ring op node, as its readers take it.

The attention rules record the description of each ring op they emit (``facts(node).ring_call``);
a node they did not emit (AOTAutograd's graphs, a ring op the user's code called) has none, and
its call is read off the node by the op's schema::

    ring_call(node)   # facts(node).ring_call, else call_spec.read_ring_call(node)

Kept out of :mod:`cp_compile.ring` so the ring does not import the passes (imports point one way).
"""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx

from ..ring.call_spec import RingCall, read_ring_call
from .node_facts import facts, set_facts


def ring_call(node: fx.Node) -> RingCall:
    """The description of a ring op node: the one its rule recorded, else the one read by schema."""
    emitted = facts(node).ring_call
    return emitted if emitted is not None else read_ring_call(node)


def pass_timeout(node: fx.Node, timeout: float) -> None:
    """Give a ring op node ``timeout`` (seconds each ring wait may take), its description updated alike."""
    node.kwargs = {**node.kwargs, "timeout": float(timeout)}
    emitted = facts(node).ring_call
    if emitted is not None:
        set_facts(node, ring_call=replace(emitted, timeout=float(timeout)))
