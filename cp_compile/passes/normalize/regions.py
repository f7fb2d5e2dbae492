"""Regions Dynamo keeps as subgraphs: opened for the rewrite, checkpointed again after it.

Dynamo puts an activation-checkpointed region (``torch.utils.checkpoint`` with either
``use_reentrant``, Hugging Face gradient checkpointing, ``checkpoint_wrapper``, selective AC
with a ``context_fn``) into ``tag_activation_checkpoint(body, *operands)``, and a
``torch.compiler.nested_compile_region`` into ``invoke_subgraph(body, name, *operands)``.
The body is a graph of its own, which the layout propagation would have to enter with every
rule. Instead, :func:`inline_regions` (a pass of the pipeline, early) copies each body into the calling graph,
so attention, masks, losses and fallbacks inside it are found, rewritten and recorded as at top
level, and marks each copied node with its :class:`Region`::

    before:  h = tag_activation_checkpoint(wrap_body_0, x, w)[0]        wrap_body_0: q = x @ w; sdpa(q, ..)
    after:   q = x @ w;  a = sdpa(q, ..);  h = a        (facts(node).region = Region(1, "checkpoint", ..))

The rewrite stamps every node it emits for a marked node with the same region
(:func:`stamp_region`). :func:`checkpoint_regions` (run by the backend at the hand-off, after
the pipeline) then tells AOTAutograd's partitioner what to recompute, the way
``tag_activation_checkpoint`` itself does when it is traced: every node of a checkpointed region
gets ``meta["recompute"] = PREFER_RECOMPUTE`` and the region's ``ac_graph_id`` (AOTAutograd
copies both onto the aten nodes each node traces to), except the nodes that communicate (the
ring op, gathers, all-reduces), which are ``MUST_SAVE``: recomputing the region in the backward
never runs the ring forward again nor re-sends K/V; the ring backward reads the saved output and
logsumexp, as torchtitan's op-level SAC policy saves flash attention's. A selective-AC policy
(``context_fn``) is applied per aten op by torch's own dispatch mode, so such a region is put
back into ``tag_activation_checkpoint`` with the policy wrapped to save the communicating ops
(:mod:`.region_outline`). A nested compile region is only a compile-time hint: inlined, it is
compiled with the rest.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ... import graph_ops
from ..context import log, source_line
from ..node_facts import facts, set_facts
from ..finalize.region_outline import communicating_op, outline_selective

_HOP = torch.ops.higher_order
# higher-order op -> (the kind of region, how many leading arguments are not operands)
INLINED = {_HOP.tag_activation_checkpoint: ("checkpoint", 1), _HOP.invoke_subgraph: ("subgraph", 2),
           _HOP.wrap: ("subgraph", 1)}
_ids = itertools.count(1)  # ac_graph_id: increasing in graph order, as the partitioner expects


@dataclass
class Region:
    """One region Dynamo had kept as a subgraph: what it was, where, and its checkpoint policy."""

    id: int
    kind: str  # "checkpoint" (activation checkpointing) or "subgraph" (nested_compile_region, wrap)
    line: str  # the model source line of the call
    context_fn: Optional[Callable] = None  # selective AC: torch.utils.checkpoint's context_fn
    kwargs: Dict[str, Any] = field(default_factory=dict)  # the checkpoint call's own kwargs

    @property
    def checkpointed(self) -> bool:
        return self.kind == "checkpoint"

    def describe(self) -> str:
        """What the region is and what the backward does with it, for the record and explain."""
        if not self.checkpointed:
            return f"nested compile region at {self.line}: inlined"
        if self.context_fn is not None:
            return (f"selective activation checkpointing at {self.line}: its policy decides what is recomputed; "
                    "ring attention saved")
        return f"activation checkpointing at {self.line}: recomputed in the backward, ring attention saved"


def region_of(node: fx.Node) -> Optional[Region]:
    """The region ``node`` was copied out of (or emitted for), if any (:mod:`..node_facts`)."""
    return facts(node).region


def inline_regions(gm: fx.GraphModule) -> List[Region]:
    """Copy every ``tag_activation_checkpoint`` / ``invoke_subgraph`` / ``wrap`` body into ``gm``
    (nested ones too: the outermost checkpointed region wins, a checkpoint inside a nested compile
    region stays a checkpoint); return the regions, in graph order."""
    regions: List[Region] = []
    while True:
        hop = next((n for n in gm.graph.nodes if _inlinable(gm, n)), None)
        if hop is None:
            break
        outer = region_of(hop)  # hop was copied out of another region's body
        checkpoint = INLINED[hop.target][0] == "checkpoint"
        region = outer if outer is not None and (outer.checkpointed or not checkpoint) else _new_region(gm, hop)
        if region not in regions:
            regions.append(region)
        _inline(gm, hop, region)
    if regions:
        gm.graph.lint()
        gm.recompile()
        log.info("cp_compile: opened %d region(s): %s", len(regions), "; ".join(r.describe() for r in regions))
    return regions


def _inlinable(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A region call whose body is a GraphModule and whose results are read only by index."""
    if node.op != "call_function" or node.target not in INLINED:
        return False
    body = node.args[0]
    if not (isinstance(body, fx.Node) and body.op == "get_attr"):
        return False
    return all(u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users)


def _new_region(gm: fx.GraphModule, hop: fx.Node) -> Region:
    kind, _ = INLINED[hop.target]
    body = gm.get_submodule(hop.args[0].target)
    return Region(next(_ids), kind, source_line(hop), body.meta.get("_checkpoint_context_fn"), dict(hop.kwargs))


def _inline(gm: fx.GraphModule, hop: fx.Node, region: Region) -> None:
    """Replace ``hop`` by a copy of its body, each copied node marked with ``region``."""
    body: fx.GraphModule = gm.get_submodule(hop.args[0].target)
    operands = hop.args[INLINED[hop.target][1]:]
    env: Dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for ph, value in zip(placeholders, operands):
        env[ph] = value
    outputs: Any = None
    with gm.graph.inserting_before(hop):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = fx.node.map_arg(node.args[0], lambda a: env[a])
                break
            if node.op == "get_attr":  # a nested body or a constant of the body: give it a name in gm
                env[node] = gm.graph.get_attr(_adopt(gm, body, node.target))
            else:
                env[node] = gm.graph.node_copy(node, lambda a: env[a])
            set_facts(env[node], region=region)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(hop.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    body_attr = hop.args[0]
    gm.graph.erase_node(hop)
    if not body_attr.users:
        gm.graph.erase_node(body_attr)


def _adopt(gm: fx.GraphModule, body: fx.GraphModule, target: str) -> str:
    """Register ``body``'s attribute ``target`` on ``gm`` under a fresh name."""
    value = operator.attrgetter(target)(body)
    name = f"_cp_region_{target.replace('.', '_')}"
    while hasattr(gm, name):
        name += "_"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name


class stamp_region:
    """Context of the rewrite walk: nodes emitted for a marked old node join its region.

    ``with stamp_region(graph, old):`` ... every node appended to ``graph`` inside the block
    that has no region yet gets ``old``'s (a ring op, an index, a gather emitted for it)."""

    def __init__(self, graph: fx.Graph, old: fx.Node) -> None:
        self.graph, self.region = graph, region_of(old)

    def __enter__(self) -> "stamp_region":
        self.last = self.graph._root.prev  # the graph's last node so far
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.region is None or exc[0] is not None:
            return
        node = self.last.next
        while node is not self.graph._root:
            if facts(node).region is None:
                set_facts(node, region=self.region)
            node = node.next


def communicates(node: fx.Node) -> bool:
    """Whether ``node`` sends or receives (the ring op, cp_compile's collectives, c10d functional ops)."""
    return node.target in graph_ops.COMMUNICATING or communicating_op(node.target)


def checkpoint_regions(gm: fx.GraphModule, regions: List[Region]) -> fx.GraphModule:
    """Tag every node of a checkpointed region for AOTAutograd's partitioner (recompute, but save
    what communicates); a region with a selective-AC policy goes back into its higher-order op."""
    if not any(r.checkpointed for r in regions):
        return gm
    tagged = {r.id for r in regions  # the selective-AC regions put back into their op need no tags
              if r.checkpointed and not (r.context_fn is not None and outline_selective(gm, r))}
    for node in gm.graph.nodes:
        region = region_of(node)
        if region is not None and region.id in tagged and node.op not in ("placeholder", "get_attr", "output"):
            node.meta["recompute"] = (CheckpointPolicy.MUST_SAVE if communicates(node)
                                      else CheckpointPolicy.PREFER_RECOMPUTE)
            node.meta["ac_graph_id"] = region.id
    return gm
