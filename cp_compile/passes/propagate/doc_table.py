"""``load_balance="documents"``: the layout of each call computed in the graph from its document ids.

The mask analysis (:mod:`.masks.documents`) found, for every attention, the old-graph node X
(B|1, S) of the document ids its mask compares. Under ``load_balance="documents"`` the rewrite
(:mod:`.rewrite`) makes one table of X per graph::

    X = <X's construction, moved right after the placeholders>      (B|1, S), whole on every rank
    table = torch.ops.cp_compile.document_table(X, N)               (N, S/N) int64, same on every rank
    inputs[:, table[rank]] ... ring_attention_fwd(..., doc_ids=X, positions=table) ...
    outputs: gather_seq(x, order=table.reshape(-1), inverse=argsort(order))

X depends on inputs only, but Dynamo's graph computes it after the first use of the inputs
(Hugging Face builds its mask after the embedding), so the pass :mod:`..normalize.documents_first`
moved X's construction (pure ops on inputs) to the top of the old graph (``ctx.document_ids``),
and the walk shards the inputs only once the table exists. Every use of this rank's positions
(:mod:`.seqindex`) then reads
``table[rank]``, a graph value, as under a symbolic S.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

def emit_table(em: Any, ids: fx.Node) -> fx.Node:
    """The new graph's (N, S/N) table of X (already emitted, whole), kept as ``em.index.table``."""
    from ...ring import table_op  # noqa: F401 (registers the op)
    from ..analyze.masks.documents import doc_ids_value

    new_ids = doc_ids_value(em, ids, next(iter(em.ctx.attention)))  # (B|1, S) int
    em.index.table = em.call(torch.ops.cp_compile.document_table.default, new_ids, em.ctx.world)
    return em.index.table


__all__ = ["emit_table"]
