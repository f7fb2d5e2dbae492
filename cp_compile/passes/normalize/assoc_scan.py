"""Each ``associative_scan`` Dynamo traced becomes one node the rewrite can split by sequence.

Before, ``combine_mode="generic"`` (every CPU call): torch's tree scan unrolled by Dynamo, a few nodes
per leaf and level, the combine vmapped at every level::

    x_i = movedim(xs_i, dim, 0)                                    # the leaves, scan dim first (kept)
    aten.slice(x_i, 0, 0, -1, 2), aten.slice(x_i, 0, 1, None, 2)   # the first level's pairs
    _vmap_increment_nesting .. _add_batch_dim .. combine's ops .. _remove_batch_dim .. _vmap_decrement_nesting
    ... log2(S) levels of slices, vmapped combines, cat, stack, flatten, pad ...
    out_i = flatten(stack([cat([aten.slice(x_i, 0, 0, 1), ..]), odd_i], 1), 0, 1)

Before, ``combine_mode="pointwise"`` (GPU calls): ``torch.ops.higher_order.associative_scan(combine,
[x_i], [extra])``, the combine a subgraph.

After, both::

    outs = scan_leaves(combine, [x_i], [extra], batched=...)   # combine: a get_attr module

The combine module is the first level's vmap block, copied with its batch dims stripped: the user's
combine on single elements (``batched=True``: :func:`cp_compile.recurrence.scan.scan_leaves` vmaps it
again), its inputs the left leaves, the right leaves, then any tensor it closes over. A region that
does not have this shape exactly, or whose combine does not reproduce the region's output shapes on
fake tensors, is left as traced (its slices then gather, warned by the rewrite).
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ...recurrence.scan import scan_leaves
from ..context import RewriteContext, fake_value, log, source_line
from ..propagate.rules.vmap import ADD_BATCH_DIM, DECREMENT, INCREMENT, REMOVE_BATCH_DIM

_HOP = getattr(torch.ops.higher_order, "associative_scan", None)
_SLICE = torch.ops.aten.slice
_LAZY = getattr(getattr(torch._functorch, "predispatch", None), "lazy_load_decompositions", None)
_BOOKKEEPING = {INCREMENT, DECREMENT, _LAZY}
_TREE_OPS = {_SLICE, torch.cat, torch.stack, torch.flatten, F.pad, torch._C._nn.pad}  # the tree scan's ops


def collapse_associative_scans(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace every traced ``associative_scan`` by one :func:`scan_leaves` node; the count."""
    count = sum(_from_hop(gm, n) for n in list(gm.graph.nodes) if _HOP is not None and n.target is _HOP)
    claimed: Set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node not in claimed and _is_first_pair(node):
            count += _collapse_tree(gm, node, claimed)
    if count:
        gm.graph.lint()
        gm.recompile()
        log.info("cp_compile: %d associative_scan call(s) recognised", count)
    return count


def _from_hop(gm: fx.GraphModule, node: fx.Node) -> int:
    """The higher-order op: its combine is pointwise, applied to whole runs as it is. Dynamo leaves the
    first-element copies it traced the combine on in the graph, unused: they go."""
    combine, xs, extra = node.args[:3]
    for x in xs:
        for u in list(x.users):
            if u.target is torch.select_copy and not u.users:
                gm.graph.erase_node(u)
    node.target = scan_leaves
    node.args = (combine, list(xs), list(extra))
    node.kwargs = {"batched": False}
    return 1


def _is_first_pair(node: fx.Node) -> bool:
    """``aten.slice(x, 0, 0, -1, 2)``: the tree scan's first left elements (user code slices with ``[]``)."""
    return node.op == "call_function" and node.target is _SLICE and tuple(node.args[1:]) == (0, 0, -1, 2)


def _collapse_tree(gm: fx.GraphModule, start: fx.Node, claimed: Set[fx.Node]) -> int:
    """Collapse the unrolled tree scan beginning at ``start`` (module docstring); 1 if done, else 0."""
    block = _first_block(start)
    leaves = _leaves(block) if block is not None else None
    if leaves is None:
        return 0
    region = _region(start, leaves)
    claimed.update(region)
    outputs = _outputs(region, leaves)
    combine = _combine(block, region, leaves)
    if outputs is None or combine is None:
        log.debug("cp_compile: associative_scan at %s left as traced (an unexpected shape)", source_line(start))
        return 0
    module, extra = combine
    if not _reproduces(module, leaves, extra, outputs):
        log.debug("cp_compile: associative_scan at %s left as traced (its combine did not check)", source_line(start))
        return 0
    _replace(gm, start, region, leaves, extra, module, outputs)
    return 1


def _first_block(start: fx.Node) -> Optional[List[fx.Node]]:
    """The nodes of the first vmap block after ``start`` (increment .. decrement, both included)."""
    node, block = start.next, None
    while node.op != "output":
        if node.target is INCREMENT and block is None:
            block = []
        if block is not None:
            block.append(node)
            if node.target is DECREMENT:
                return block
        elif node.target not in (_SLICE, _LAZY):
            return None
        node = node.next
    return None


def _leaves(block: List[fx.Node]) -> Optional[List[fx.Node]]:
    """The scanned leaves: the block's batched inputs are ``x_i[0:-1:2]`` for every leaf, then ``x_i[1::2]``."""
    batched = [n.args[0] for n in block if n.target is ADD_BATCH_DIM]
    if len(batched) % 2 or not batched or not all(isinstance(b, fx.Node) and b.target is _SLICE for b in batched):
        return None
    half = len(batched) // 2
    left, right = batched[:half], batched[half:]
    if any(tuple(b.args[1:]) != (0, 0, -1, 2) for b in left) or any(
            tuple(b.args[1:]) not in ((0, 1, None, 2), (0, 1, 9223372036854775807, 2)) for b in right):
        return None
    leaves = [b.args[0] for b in left]
    return leaves if leaves == [b.args[0] for b in right] else None


def _region(start: fx.Node, leaves: Sequence[fx.Node]) -> List[fx.Node]:
    """The tree scan's nodes, in graph order: from ``start`` while a node is bookkeeping, inside a vmap
    block, or a tree op reading the scan; the first other node ends it."""
    readable, region, depth = set(leaves), [], 0
    node = start
    while node.op != "output":
        depth += (node.target is INCREMENT) - (node.target is DECREMENT)
        reads = any(a in readable for a in node.all_input_nodes)
        if not (node.target in _BOOKKEEPING or depth > 0 or node.target in (ADD_BATCH_DIM, REMOVE_BATCH_DIM)
                or node.target in _TREE_OPS and reads):
            break
        region.append(node)
        readable.add(node)
        node = node.next
    return region


def _outputs(region: List[fx.Node], leaves: Sequence[fx.Node]) -> Optional[Dict[fx.Node, int]]:
    """Each region node read after the region -> the leaf it is the scan of, or None if one is not known."""
    inside = set(region)
    found: Dict[fx.Node, int] = {}
    for node in region:
        if any(u not in inside for u in node.users):
            i = _leaf_of(node, leaves)
            if i is None:
                return None
            found[node] = i
    return found or None


def _leaf_of(node: fx.Node, leaves: Sequence[fx.Node]) -> Optional[int]:
    """Which leaf an output scans: ``[aten.slice](flatten(stack([cat([aten.slice(x_i, 0, 0, 1), ..]), ..])))``."""
    if node.target is _SLICE:
        node = node.args[0]
    if node.target is not torch.flatten or node.args[0].target is not torch.stack:
        return None
    even = node.args[0].args[0][0]
    if even.target is not torch.cat or even.args[0][0].target is not _SLICE:
        return None
    first = even.args[0][0].args[0]
    return leaves.index(first) if first in leaves else None


def _combine(block: List[fx.Node], region: List[fx.Node], leaves: Sequence[fx.Node]):
    """(the combine as a module on single elements, the outer tensors it reads), or None."""
    graph, env = fx.Graph(), {}
    inside = set(region)
    for n in block:
        if n.target is ADD_BATCH_DIM:
            env[n] = graph.placeholder(f"x{len(env)}")
    extra = [a for n in block if n.target not in _BOOKKEEPING | {ADD_BATCH_DIM, REMOVE_BATCH_DIM}
             for a in n.all_input_nodes if a not in inside]
    extra = list(dict.fromkeys(extra))
    if any(a not in inside and a not in extra and a not in leaves for n in region for a in n.all_input_nodes):
        return None  # a later level reads something the first does not: not one combine
    for a in extra:
        env[a] = graph.placeholder(f"extra{len(env)}")
    outs = []
    for n in block:
        if n.target is REMOVE_BATCH_DIM:
            outs.append(env[n.args[0]])
        elif n.target not in _BOOKKEEPING and n.target is not ADD_BATCH_DIM:
            env[n] = graph.node_copy(n, lambda a: env[a])
    if len(outs) != len(leaves):
        return None
    graph.output(outs)
    return fx.GraphModule(torch.nn.Module(), graph), extra


def _reproduces(module: fx.GraphModule, leaves: Sequence[fx.Node], extra: Sequence[fx.Node],
                outputs: Dict[fx.Node, int]) -> bool:
    """Whether the scan by ``module`` gives each read output its traced shape and dtype (fake tensors)."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            xs = [_fresh(fake_value(x)) for x in leaves]
            got = scan_leaves(module, xs, [_fresh(fake_value(a)) for a in extra])
    except Exception as e:  # noqa: BLE001  (any failure: not a combine we can run; the region stays)
        log.debug("cp_compile: the extracted combine failed on fake tensors: %s", e)
        return False
    want = {i: fake_value(o) for o, i in outputs.items()}
    return all(tuple(got[i].shape) == tuple(v.shape) and got[i].dtype == v.dtype for i, v in want.items())


def _fresh(v):
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)


def _replace(gm: fx.GraphModule, start: fx.Node, region: List[fx.Node], leaves: Sequence[fx.Node],
             extra: Sequence[fx.Node], module: fx.GraphModule, outputs: Dict[fx.Node, int]) -> None:
    """One ``scan_leaves`` node before the region; the region's reads go to its items; the region erased."""
    name = _free_name(gm, "_cp_scan_combine")
    gm.add_submodule(name, module)
    g = gm.graph
    with g.inserting_before(start):
        attr = g.get_attr(name)
        new = g.call_function(scan_leaves, (attr, list(leaves), list(extra)), {"batched": True})
        items = [g.call_function(operator.getitem, (new, i)) for i in range(len(leaves))]
    new.meta = {k: v for k, v in start.meta.items() if k != "example_value"}
    values = {i: fake_value(o) for o, i in outputs.items()}
    for i, item in enumerate(items):
        value = values.get(i, None)
        item.meta = {**new.meta, "example_value": value if value is not None else _like(fake_value(leaves[i]))}
    new.meta["example_value"] = [it.meta["example_value"] for it in items]
    inside = set(region)
    for out, i in outputs.items():
        out.replace_all_uses_with(items[i], delete_user_cb=lambda u: u not in inside)
    for node in reversed(region):
        g.erase_node(node)


def _like(v):
    """A fake tensor shaped like leaf ``v``, contiguous (what the tree scan returns for it)."""
    return v.new_empty(tuple(v.shape))


def _free_name(gm: fx.GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


__all__ = ["collapse_associative_scans"]
