"""``load_balance="documents"``: the document ids' construction moved to the top of the graph.

The mask analysis (:mod:`..analyze.masks.documents`) found, for every attention, the node X
(B|1, S) of the document ids its mask compares; the rewrite computes this call's layout from X
(:mod:`..propagate.doc_table`) before it shards any input. X depends on inputs only, but Dynamo's
graph computes it after the first use of the inputs (Hugging Face builds its mask after the
embedding). Before::

    x = placeholder; ids = placeholder
    h = embed(x)                         # the first use of an input
    X = ids[:, :, None] ...              # the ids' construction (pure ops on inputs)
    mask = X == X.mT ...

After (``ctx.document_ids = X``)::

    x = placeholder; ids = placeholder
    X = ids[:, :, None] ...              # moved: right after the placeholders
    h = embed(x)
    mask = X == X.mT ...

Refused, naming the fix: an attention without a document mask, attentions comparing different
ids, ids computed in place, a dynamic S, or an S the ranks do not divide.
"""

from __future__ import annotations

from typing import List

import torch.fx as fx

from ..context import CPRewriteError, RewriteContext
from ..fx_utils import mutates, source_line

_ZIGZAG = "Fix: load_balance='zigzag' (the default)"


def _refuse(what: str, fix: str = _ZIGZAG) -> None:
    raise CPRewriteError(f"cp_compile: load_balance='documents': {what}. {fix}.")


def _document_ids(ctx: RewriteContext) -> fx.Node:
    """The one ids node X every attention's mask compares (refusals name the attention and the fix)."""
    found = []
    for node in ctx.attention:
        kind = ctx.masks.get(node)
        if kind is None or getattr(kind, "doc_ids", None) is None:
            _refuse(f"the attention at {source_line(node)} has no document mask (X[b, q] == X[b, kv]), so no "
                    "document layout serves it", _ZIGZAG + ", or give that attention the document term too")
        found.append(_unwrapped(kind.doc_ids))
    if len(set(found)) != 1:
        where = "; ".join(f"{x.name} ({source_line(x)})" for x in dict.fromkeys(found))
        _refuse(f"the attentions compare different document ids ({where}); one layout needs one set of ids",
                _ZIGZAG + ", or compute the ids once and use them in every mask")
    return found[0]


def _unwrapped(ids: fx.Node) -> fx.Node:
    """``x`` for ``whole(x)`` (:func:`.masks.documents.whole` marks a mask's read of an input; same values)."""
    from ..analyze.masks.documents import whole

    while ids.op == "call_function" and ids.target is whole:
        ids = ids.args[0]
    return ids


def _check_call(ctx: RewriteContext) -> None:
    if ctx.options.inputs == "local":
        _refuse("inputs='local' gives each rank a shard cut with a fixed layout, while this layout is computed "
                "from each batch's documents", "Fix: inputs='full' (every rank passes the whole batch), or "
                "load_balance='zigzag'")
    if ctx.seq_sym is not None:
        _refuse(f"the sequence length is dynamic ({ctx.seq_sym}); the document layout is supported with static "
                "shapes", "Fix: torch.compile(..., dynamic=False) (a new length recompiles), or load_balance='zigzag'")
    if ctx.seq_len % ctx.world:
        _refuse(f"the sequence length {ctx.seq_len} does not divide by the {ctx.world} ranks and the table has no "
                "padding", f"Fix: pad the batch to a multiple of {ctx.world} tokens (e.g. a padding document "
                "at the end), or load_balance='zigzag', which pads")


def documents_first(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Under load_balance="documents": X checked and kept as ``ctx.document_ids``, its construction
    moved to follow the placeholders (see the module docstring). Idempotent."""
    if ctx.options.load_balance != "documents":
        return
    _check_call(ctx)
    ids = _document_ids(ctx)
    closure = _ancestors(ids)
    impure = [n for n in closure if mutates(n)]
    if impure:
        _refuse(f"the document ids {ids.name} are computed with an in-place op ({source_line(impure[0])})",
                "Fix: compute the document ids with out-of-place ops, or load_balance='zigzag'")
    anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for node in closure:  # graph order: each lands after its inputs
        if node.prev is not anchor:
            anchor.append(node)
        anchor = node
    gm.graph.lint()
    ctx.document_ids = ids


def _ancestors(ids: fx.Node) -> List[fx.Node]:
    """``ids`` and every node it is computed from but the placeholders, in graph order."""
    seen, todo = set(), [ids]
    while todo:
        node = todo.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(ids.graph.nodes)}
    return sorted(seen, key=order.__getitem__)
