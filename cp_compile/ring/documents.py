"""Packed documents: document ids over global positions, and the equal-document rectangles.

A packed sequence holds several documents; a key is visible to a query only inside the
same document. The ring takes that as ``doc_ids`` (B|1, S): one integer per *global*
position (every rank passes the same whole tensor, 4-8 bytes a token), and never builds
a mask for it: each plan rectangle (:class:`.plan.Segment`) is split into its
sub-rectangles of equal document (:func:`doc_rectangles`), each one dense block-kernel
call, full or causal, so pairs in different documents are never computed.

Why that split is small: a rank's rows (and a visiting block's keys) are in increasing
global order, so a document that is a contiguous range of positions is a contiguous
range of local rows, one run. Ids need not be sorted (runs are matched by id), but each
run of equal ids costs one call per matching key run.

Public helpers: :func:`doc_ids_from_cu_seqlens` (flash-attn's varlen form) and
:func:`doc_ids_from_position_ids` (Hugging Face's packed batches).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterator, List, Optional, Tuple

import torch

Tensor = torch.Tensor
Run = Tuple[int, int, int]  # (document id, first row, one past the last row)
Rect = Tuple[int, int, int, int, bool]  # (q start, q stop, k start, k stop, causal), segment-relative


def doc_ids_from_cu_seqlens(cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """(1, S) int32 document ids from flash-attn style ``cu_seqlens`` = [0, l0, l0+l1, ..., S].

    Position p belongs to document i when ``cu_seqlens[i] <= p < cu_seqlens[i+1]``; when
    ``cu_seqlens[-1] < seq_len`` the positions after it (padding) form one more document.
    """
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(
            f"cp_compile.doc_ids_from_cu_seqlens: cu_seqlens has shape {tuple(cu.shape)} and dtype {cu.dtype}; "
            "expected a 1-D integer tensor [0, l0, l0+l1, ..., S]. Fix: pass flash-attn's cu_seqlens "
            "(torch.int32), one entry more than the number of documents."
        )
    cu = cu.long()
    bad = int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > seq_len
    if bad:
        raise ValueError(
            f"cp_compile.doc_ids_from_cu_seqlens: cu_seqlens {cu.tolist()[:8]}... must start at 0, never "
            f"decrease and end at most at seq_len={seq_len}. Fix: cu_seqlens = [0, *torch.cumsum(lengths, 0)]."
        )
    pos = torch.arange(seq_len, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True).to(torch.int32).unsqueeze(0)  # (1, S)


def doc_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """(B, S) int32 document ids: a new document starts wherever ``position_ids`` does not go up by 1.

    That is how Hugging Face reads packed batches (``position_ids`` restarting at 0 at
    each document start, e.g. from ``DataCollatorWithFlattening``). (S,) is read as (1, S).
    """
    p = torch.as_tensor(position_ids)
    if p.dim() == 1:
        p = p.unsqueeze(0)
    if p.dim() != 2 or p.dtype.is_floating_point or p.dtype == torch.bool or p.shape[1] == 0:
        raise ValueError(
            f"cp_compile.doc_ids_from_position_ids: position_ids has shape {tuple(p.shape)} and dtype "
            f"{p.dtype}; expected integer (B, S). Fix: pass the position_ids the model gets."
        )
    p = p.long()
    starts = torch.ones_like(p, dtype=torch.int32)
    starts[:, 1:] = (p[:, 1:] != p[:, :-1] + 1).to(torch.int32)
    return (torch.cumsum(starts, dim=1) - 1).to(torch.int32)  # (B, S)


def runs(ids: Tensor) -> List[Run]:
    """Maximal runs of equal values of the 1-D ``ids``: [(id, start, stop), ...]."""
    if ids.numel() == 0:
        return []
    cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, ids.numel()]
    vals = ids[bounds[:-1]].tolist()
    return [(vals[i], bounds[i], bounds[i + 1]) for i in range(len(vals))]


def _staircase(a: int, b: int, e: int, f: int) -> Iterator[Rect]:
    """Rows [a, b) x cols [e, f) of an index-causal rectangle (col j visible to row i iff j <= i),
    as at most three kernel calls: a full block left of the diagonal, the causal square on
    it, and the full block below the square."""
    f, a = min(f, b), max(a, e)  # cols >= b and rows < e see nothing
    if e >= f or a >= b:
        return
    if e < a:
        yield (a, b, e, min(a, f), False)
    if a < f:
        yield (a, f, a, f, True)
        if f < b:
            yield (f, b, a, f, False)


def doc_rectangles(q_ids: Tensor, k_ids: Tensor, causal: bool) -> List[Rect]:
    """The equal-document sub-rectangles of one plan rectangle with these row / key ids (1-D).

    ``causal``: the rectangle is index-causal (Lq == Lk, row i sees keys 0..i), as the
    plan's causal segments are; each document's part then is a causal square on the
    diagonal (up to two full blocks beside it when key runs start before query runs).
    """
    by_id: Dict[int, List[Tuple[int, int]]] = defaultdict(list)
    for doc, e, f in runs(k_ids):
        by_id[doc].append((e, f))
    rects: List[Rect] = []
    for doc, a, b in runs(q_ids):
        for e, f in by_id.get(doc, ()):
            rects.extend(_staircase(a, b, e, f) if causal else [(a, b, e, f, False)])
    return rects


def padded_ids(doc_ids: Tensor, seq_len: int) -> Tensor:
    """``doc_ids`` (S'), or (B|1, S') with S' <= ``seq_len``, as (B|1, seq_len) int64 on the CPU: ids of a
    sequence the backend padded are extended with the last id (no real query sees a padding key)."""
    ids = doc_ids.detach().to("cpu", torch.int64)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids  # (B|1, S')
    if ids.shape[1] < seq_len:
        ids = torch.cat([ids, ids[:, -1:].expand(-1, seq_len - ids.shape[1])], dim=1)
    return ids


class DocIndex:
    """The document ids of one ring call on the CPU, read per batch group and position.

    ``doc_ids`` (B|1, S') with S' <= ``seq_len``: ids of a sequence the backend padded to
    ``seq_len`` (the op's ``valid_len`` <= S') are extended with the last id, as the fused
    loops do; no real query ever sees a padding key, so the choice only fixes padding rows.

    ``groups``: the batch rows that share their ids: ``[slice(None)]`` when ``doc_ids``
    has batch 1 or all its rows are equal (one call serves every row), else one
    ``slice(b, b + 1)`` per row.
    """

    def __init__(self, doc_ids: Tensor, seq_len: int) -> None:
        ids = padded_ids(doc_ids, seq_len)  # (B|1, S) int64 on the CPU
        if ids.shape[0] > 1 and bool((ids == ids[:1]).all()):
            ids = ids[:1]
        self.ids = ids
        self.groups = [slice(None)] if ids.shape[0] == 1 else [slice(b, b + 1) for b in range(ids.shape[0])]

    def at(self, group: int, pos: Tensor) -> Tensor:
        """Ids (1-D int64) of batch group ``group`` at CPU positions ``pos``."""
        return self.ids[group].index_select(0, pos)

    def same_doc(self, q_pos: Tensor, k_pos: Tensor, device: Optional[torch.device] = None) -> Tensor:
        """(B|1, 1, Lq, Lk) bool: key in the query's document (positions on the CPU)."""
        vis = self.ids[:, q_pos][:, :, None] == self.ids[:, k_pos][:, None, :]
        return vis.unsqueeze(1).to(device if device is not None else vis.device)
