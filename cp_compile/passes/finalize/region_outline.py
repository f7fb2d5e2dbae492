"""A selective-AC region put back into ``tag_activation_checkpoint`` after the rewrite.

A selective activation-checkpointing policy (``torch.utils.checkpoint(.., context_fn=...)``,
``create_selective_checkpoint_contexts(policy)``) is a function of aten ops, applied while
AOTAutograd traces the region under its dispatch mode. :mod:`.regions` opened the region for the
rewrite; :func:`outline_selective` moves its rewritten nodes back into a body, with the user's
policy wrapped so that what communicates (the ring op, cp_compile's collectives) is saved::

    before:  q = x @ wq;  (out, lse) = ring_attention_fwd(q, ..);  y = out @ wo      (all in region 3)
    after:   r = tag_activation_checkpoint(region_3, x, wq, wo, .., use_reentrant=False);  y = r[0]
             region_3.meta["_checkpoint_context_fn"] = the user's context_fn, ring ops MUST_SAVE

The region must be convex in the rewritten graph (no path leaves it and comes back); outside
nodes between its first and last node that read it move after the call. A region that is not
convex is left open and tagged as full AC by :func:`.regions.checkpoint_regions` (logged).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, List, Optional, Set

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..context import log

COMMUNICATING_NAMESPACES = ("cp_compile", "_c10d_functional", "c10d_functional")  # saved, never recomputed


def outline_selective(gm: fx.GraphModule, region: Any) -> bool:
    """Move ``region``'s nodes of ``gm`` into a ``tag_activation_checkpoint`` body; False when it
    cannot (the region is not convex, or holds a module call)."""
    nodes = [n for n in gm.graph.nodes
             if n.meta.get("cp_region") is region and n.op in ("call_function", "call_method")]
    inside = set(nodes)
    moved = _readers_between(nodes, inside)
    if not nodes or moved is None or any(n.meta.get("cp_region") is region and n.op == "call_module"
                                         for n in gm.graph.nodes):
        log.warning("cp_compile: the selective activation checkpointing policy of %s cannot be kept after the "
                    "rewrite (the region is not one piece): the region is checkpointed whole, its ring "
                    "attention saved", region.describe())
        return False
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body = _body(gm, nodes, inputs, outputs)
    body.meta["_checkpoint_context_fn"] = _saving_communication(region.context_fn)
    name = f"cp_region_{region.id}"
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, body)
    with gm.graph.inserting_after(nodes[-1]):
        attr = gm.graph.get_attr(name)
    with gm.graph.inserting_after(attr):
        call = gm.graph.call_function(torch.ops.higher_order.tag_activation_checkpoint, (attr, *inputs),
                                      dict(region.kwargs))
    results = _unpack(gm, call, outputs, inside)
    anchor = results[-1] if results else call
    for node in moved:  # outside readers of the region that sat inside its span: after its results
        anchor.append(node)
        anchor = node
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return True


def _readers_between(nodes: List[fx.Node], inside: Set[fx.Node]) -> Optional[List[fx.Node]]:
    """Outside nodes within the region's span that read it (to move after it); None when one of
    them is read back by the region (not convex)."""
    if not nodes:
        return []
    readers: List[fx.Node] = []
    tainted: Set[fx.Node] = set()
    node = nodes[0]
    while node is not nodes[-1].next:
        reads = node.all_input_nodes
        if node in inside:
            if any(a in tainted for a in reads):
                return None
        elif any(a in inside or a in tainted for a in reads):
            tainted.add(node)
            readers.append(node)
        node = node.next
    return readers


def _body(gm: fx.GraphModule, nodes: List[fx.Node], inputs: List[fx.Node], outputs: List[fx.Node]) -> fx.GraphModule:
    """A GraphModule computing ``outputs`` from ``inputs`` with copies of ``nodes``."""
    graph = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph)


def _unpack(gm: fx.GraphModule, call: fx.Node, outputs: List[fx.Node], inside: Set[fx.Node]) -> List[fx.Node]:
    """``call[i]`` for each output, read by the outside users of ``outputs[i]`` instead."""
    results, anchor = [], call
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta = {k: v for k, v in out.meta.items() if k in ("val", "example_value", "stack_trace")}
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        results.append(item)
        anchor = item
    return results


def _saving_communication(context_fn: Callable) -> Callable:
    """``context_fn`` whose policy saves every op that sends or receives (never recomputed)."""

    def context_fn_saving_communication() -> Any:
        contexts = context_fn()
        for mode in contexts:
            if hasattr(mode, "policy_fn"):
                mode.policy_fn = functools.partial(_save_communication, mode.policy_fn)
        return contexts

    return context_fn_saving_communication


def communicating_op(target: Any) -> bool:
    """Whether an operator (a graph node's target, or the aten-level op a selective-AC policy is
    asked about) is in a namespace that sends or receives: the ring op, c10d functional ops."""
    namespace = getattr(target, "namespace", None) or getattr(getattr(target, "_schema", None), "name", "")
    return str(namespace).split("::")[0] in COMMUNICATING_NAMESPACES


def _save_communication(policy: Callable, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    if communicating_op(func):
        return CheckpointPolicy.MUST_SAVE
    return policy(ctx, func, *args, **kwargs)
