"""``load_balance="documents"``: the layout of each call computed in the graph from its document ids.

The mask analysis (:mod:`.masks.documents`) found, for every attention, the old-graph node X
(B|1, S) of the document ids its mask compares. Under ``load_balance="documents"`` the rewrite
(:mod:`.rewrite`) makes one table of X per graph::

    X = <X's construction, moved right after the placeholders>      (B|1, S), whole on every rank
    table = torch.ops.cp_compile.document_table(X, N)               (N, S/N) int64, same on every rank
    inputs[:, table[rank]] ... ring_attention_fwd(..., doc_ids=X, positions=table) ...
    outputs: gather_seq(x, order=table.reshape(-1), inverse=argsort(order))

X depends on inputs only, but Dynamo's graph computes it after the first use of the inputs
(Hugging Face builds its mask after the embedding), so :func:`documents_first` moves X's
construction (pure ops on inputs) to the top of the old graph, and the walk shards the inputs
only once the table exists. Every use of this rank's positions (:mod:`.seqindex`) then reads
``table[rank]``, a graph value, as under a symbolic S.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.fx as fx

from ..context import CPRewriteError, RewriteContext, source_line
from .emitter import mutates

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
    if ctx.inputs == "local":
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


def documents_first(gm: fx.GraphModule, ctx: RewriteContext) -> Optional[fx.Node]:
    """Under load_balance="documents": X (checked), its construction moved to follow the placeholders.
    Else None. Idempotent (the trial rewrites of :mod:`.seq_inputs` call it again)."""
    if ctx.load_balance != "documents":
        return None
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
    return ids


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


def emit_table(em: Any, ids: fx.Node) -> fx.Node:
    """The new graph's (N, S/N) table of X (already emitted, whole), kept as ``em.index.table``."""
    from ...ring import table_op  # noqa: F401 (registers the op)
    from ..analyze.masks.documents import doc_ids_value

    new_ids = doc_ids_value(em, ids, next(iter(em.ctx.attention)))  # (B|1, S) int
    em.index.table = em.call(torch.ops.cp_compile.document_table.default, new_ids, em.ctx.world)
    return em.index.table


__all__ = ["documents_first", "emit_table"]
