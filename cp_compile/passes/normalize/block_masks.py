"""The BlockMask of every flex_attention, taken out of the node: the ring evaluates the mask_mod instead.

Before (:mod:`..analyze.find_flex` parsed each node; ``create_block_mask`` traced into the graph)::

    dense = vmap(mask_mod)(b, h, q_idx, kv_idx) ...; kv_num_blocks = dense.sum(-1) ...   # O(S²)
    flex_attention(q, k, v, score_mod_0, (S, S, kv_num_blocks, kv_indices, ..., mask_fn_0), ...)

After::

    flex_attention(q, k, v, score_mod_0, (S, S, None, None, ..., mask_fn_0), ...)

The mask_mod's ``get_attr`` stays (the flex rule reads it); what computed only the block
tensors (create_block_mask's vmap, block sums, argsorts, index_put) is erased, and so are the
vmap brackets left empty. A BlockMask passed in as an argument loses only its reads.
"""

from __future__ import annotations

from typing import Any, List, Set

import torch.fx as fx

from ..analyze.find_flex import is_flex
from ..context import RewriteContext
from ..fx_utils import erase_unused, mutates


def drop_block_masks(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Take the BlockMask tensors out of each flex node of ``ctx.attention`` (the ring evaluates the
    mask_mod per rectangle) and erase what computed only them: create_block_mask's O(S²) vmap,
    block sums and argsorts."""
    nodes = [n for n in ctx.attention if is_flex(n)]
    if not nodes:
        return
    roots: List[fx.Node] = []
    for node in nodes:
        block = node.args[4]
        keep = len(block) - 1  # the mask_mod get_attr stays: the rule reads it
        roots += [b for i, b in enumerate(block) if isinstance(b, fx.Node) and i != keep]
        new_block = tuple(None if isinstance(b, fx.Node) and i != keep else b for i, b in enumerate(block))
        node.args = (*node.args[:4], new_block, *node.args[5:])
    _erase_slice(gm.graph, roots)
    unused_batch_dims = [n for n in gm.graph.nodes if _name(n) == "_add_batch_dim" and not n.users]
    erase_unused(gm.graph, unused_batch_dims)  # vmap over b and h that the mask_mod never read
    _erase_empty_vmaps(gm.graph)
    gm.recompile()


def _erase_slice(graph: fx.Graph, roots: List[fx.Node]) -> None:
    """Erase the largest set of nodes feeding ``roots`` that nothing outside the set reads.

    In-place writes into a member (create_block_mask's ``dense_mask[rows, cols] = 1``) join the set
    with their inputs; a write into anything else (an input, a buffer) keeps its target alive."""
    members: Set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in members or n.op not in ("call_function", "call_method"):
            continue
        members.add(n)
        todo += n.all_input_nodes
        todo += [u for u in n.users if _writes_into(u, n)]
    changed = True
    while changed:  # drop members read from outside the set, until none is
        changed = False
        for n in list(members):
            writes_outside = mutates(n) and not (n.args and n.args[0] in members)
            if writes_outside or any(u not in members for u in n.users):
                members.discard(n)
                changed = True
    for n in reversed(list(graph.nodes)):
        if n in members:
            graph.erase_node(n)


def _writes_into(user: fx.Node, node: fx.Node) -> bool:
    return user.op in ("call_function", "call_method") and mutates(user) and bool(user.args) \
        and user.args[0] is node


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _erase_empty_vmaps(graph: fx.Graph) -> None:
    """Erase vmap brackets (increment ... decrement nesting) with nothing left between them."""
    stack: List[List[Any]] = []  # [increment node, whether something remains inside]
    for n in list(graph.nodes):
        name = _name(n)
        if name == "_vmap_increment_nesting":
            stack.append([n, False])
        elif name == "_vmap_decrement_nesting" and stack:
            inc, used = stack.pop()
            if used:
                if stack:
                    stack[-1][1] = True
                continue
            loader = inc.prev
            graph.erase_node(n)
            graph.erase_node(inc)
            if _name(loader) == "lazy_load_decompositions" and not loader.users:
                graph.erase_node(loader)
        elif name != "lazy_load_decompositions" and stack:
            stack[-1][1] = True
