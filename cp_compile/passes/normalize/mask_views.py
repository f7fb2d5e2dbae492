"""Move size-1 dim insertions below an attention mask's conjunction, so each term is classified on its own.

A mask is often built at (B, S, S) and given a head dim only at the end::

    before:  m = (doc[:, :, None] == doc[:, None, :]) & (kv <= q)     (B, S, S) & (S, S)
             sdpa(q, k, v, attn_mask=m[:, None])                      (B, 1, S, S)
    after:   m2 = (doc[:, :, None] == doc[:, None, :]).unsqueeze(-3) & (kv <= q)
             sdpa(q, k, v, attn_mask=m2)

Inserting size-1 dims commutes with an elementwise ``&`` once the insertion is counted
from the right (broadcasting aligns dims from the right): each operand gets the dims that
fall among its own, and an operand too short to reach them is left as it is, which
broadcasting already reads the same way (the ``(S, S)`` causal term above). Without this,
:mod:`.classify` sees the view of the conjunction as one opaque term and keeps the whole
mask explicit (c × S per rank), though its terms are a causal band and document ids.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..context import RewriteContext
from ..fx_utils import erase_unused, fake_value
from ..op_vocab import SDPA_PARAMS, arguments
from ..analyze.find_attention import is_sdpa
from ..analyze.find_flex import is_flex
from ..analyze.masks.classify import _AND_TARGETS  # the conjunctions classify splits: only those gain from this


def distribute_mask_views(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Give every SDPA whose ``attn_mask`` inserts dims into a conjunction the mask with the
    insertions moved onto its terms (see the module docstring); the view of the whole
    conjunction is erased once no attention reads it. Masks :mod:`.find_attention` refuses
    (with ``is_causal=True``, requiring grad) are left for it to refuse."""
    memo: Dict[fx.Node, fx.Node] = {}  # layers share one mask: moved once
    for node in list(gm.graph.nodes):
        if not is_sdpa(node) or is_flex(node):
            continue
        args = arguments(node, SDPA_PARAMS)
        mask = args.get("attn_mask")
        if not isinstance(mask, fx.Node) or args.get("is_causal", False) or _requires_grad(mask):
            continue
        moved = distribute_views(mask, memo)  # (a & b)[:, None] -> a' & b': each term on its own
        if moved is not mask:
            node.replace_input_with(mask, moved)
            erase_unused(gm.graph, [mask])  # the view of the whole conjunction, once no attention reads it


def _requires_grad(mask: fx.Node) -> bool:
    val = mask.meta.get("example_value")
    return isinstance(val, torch.Tensor) and val.requires_grad


def distribute_views(mask: fx.Node, memo: Dict[fx.Node, fx.Node]) -> fx.Node:
    """``mask`` with dim insertions applied to a conjunction moved onto its terms (new nodes in
    ``mask``'s graph), or ``mask`` itself when there is nothing to move. ``memo`` maps masks
    already done (layers share one mask) to their result."""
    if mask not in memo:
        memo[mask] = _distribute(mask)
    return memo[mask]


def _distribute(mask: fx.Node) -> fx.Node:
    inserts = _insertions(mask)  # None unless ``mask`` is a view inserting size-1 dims
    if inserts is None or not _is_and(mask.args[0]):
        return mask
    return _insert(mask.args[0], inserts, mask)


def _is_and(node) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in _AND_TARGETS \
        and _is_bool(node)


def _is_bool(node) -> bool:
    val = fake_value(node) if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype is torch.bool


def _insertions(node: fx.Node) -> Optional[List[int]]:
    """Right-counted positions (-1 is the last dim) of the size-1 dims ``node`` inserts into its
    boolean input, when that is all it does (``x[:, None]``, ``x[None]``, ``x.unsqueeze(d)``)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    if not (_is_bool(node) and isinstance(node.args[0], fx.Node) and _is_bool(node.args[0])):
        return None
    out_rank = fake_value(node).dim()
    if node.op == "call_method" and node.target == "unsqueeze" or node.target is torch.unsqueeze:
        d = arguments(node, ("input", "dim")).get("dim")
        return [d - out_rank if d >= 0 else d] if isinstance(d, int) else None
    if node.target is not operator.getitem:
        return None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not all(i is None or i == slice(None) for i in index) or None not in index:
        return None
    return [i - out_rank for i, x in enumerate(index) if x is None]


def _insert(node, inserts: List[int], like: fx.Node):
    """``node`` with size-1 dims at the right-counted positions ``inserts`` (a conjunction: on each
    operand); a position left of all of ``node``'s dims is left to broadcasting."""
    if _is_and(node):
        a, b = (_insert(x, inserts, like) for x in node.args[:2])
        if a is node.args[0] and b is node.args[1]:
            return node
        return _new(node, node.target, (a, b), fake_value(a) & fake_value(b), like)
    if not isinstance(node, fx.Node) or not isinstance(fake_value(node), torch.Tensor):
        return node
    out = node
    for p in sorted(inserts, reverse=True):  # nearest the right first: later ones do not move it
        if -p <= fake_value(out).dim():
            out = _new(out, "unsqueeze", (out, p), fake_value(out).unsqueeze(p), like)
    return out


def _new(after: fx.Node, target, args: tuple, val: torch.Tensor, like: fx.Node) -> fx.Node:
    """A node computing ``target(*args)`` right after ``after`` (source line: ``like``'s)."""
    graph = like.graph
    with graph.inserting_before(like):
        node = graph.call_method(target, args) if isinstance(target, str) else graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "source_fn_stack", "nn_module_stack")})
    node.meta["example_value"] = val
    return node
