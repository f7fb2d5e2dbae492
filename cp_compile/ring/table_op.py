"""``cp_compile::document_table(doc_ids, world_size) -> (N, S/N) int64``: the document-aware layout
as a graph op, so a compiled graph computes it from each batch's document ids.

Under ``load_balance="documents"`` the ``ring_cp`` rewrite emits it once per graph, on the whole
(B|1, S) document ids the attention masks compare (every rank holds them whole and computes the
same table: no collective), and uses row ``table[rank]`` wherever the graph needs this rank's
positions (input shards, output gathers, the ring ops' ``positions=``). The table is
:func:`cp_compile.document_layout.layout_table` of the ids: deterministic, computed on the CPU
(a few milliseconds per batch) and returned on the ids' device.
"""

from __future__ import annotations

import torch

from ..document_layout import layout_table

Tensor = torch.Tensor


@torch.library.custom_op("cp_compile::document_table", mutates_args=())
def document_table(doc_ids: Tensor, world_size: int) -> Tensor:
    """(N, S/N) int64: row r = rank r's sorted global positions for the documents of ``doc_ids``
    ((B|1, S) or (S,) integer ids; rows packed differently share the union of their boundaries)."""
    ids = doc_ids.detach().cpu()
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.shape[0] == 1:
        ids = _renumbered(ids)
    try:
        table = layout_table(ids, world_size)  # (N, S/N)
    except ValueError as err:
        raise ValueError(f"cp_compile: document_table (load_balance='documents'): {err} "
                         "Or use load_balance='zigzag'.") from None
    return table.to(doc_ids.device)


def _renumbered(ids: Tensor) -> Tensor:
    """(1, S): a new id at every change of id, so an id that comes back after another run (the mask
    joins such runs) is laid out as separate pieces; exact either way, as the layout is only a
    permutation and the ring applies the ids themselves."""
    cut = ids[0, 1:] != ids[0, :-1]  # (S - 1,)
    return torch.cat([cut.new_zeros(1), cut]).long().cumsum(0)[None]


@document_table.register_fake
def _(doc_ids: Tensor, world_size: int) -> Tensor:
    s = doc_ids.shape[-1]
    return doc_ids.new_empty((world_size, s // world_size), dtype=torch.int64)
