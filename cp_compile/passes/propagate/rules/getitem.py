"""Layout rule for basic indexing ``x[idx]`` of a Sharded value (docs/design.md §6).

    x (B, S/N, D) Sharded(1)  x[..., :D//2]   -> (B, S/N, D//2) Sharded(1)      (other dims: any basic index)
    x (B, S/N, D) Sharded(1)  x[:, 0:]        -> Sharded(1)                      (a slice covering all of S)
    x (B, S/N, D) Sharded(1)  x[:, i]         -> (B, D) Global                   (one position: cls / last token)
        = all_reduce_sum(where(positions == i, x, 0).sum(1))   O(B·D) traffic, no gather of x
    ids (B, S/N) Sharded(1)   ids[:, 1:]      -> (B, S-1) Global: the whole input every rank was passed
    cos (P, D) Global         cos[ids]        -> (B, S/N, D) Sharded(1): a whole table read at this rank's ids
    x (B, S/N, D) Sharded(1)  x[arange(B), idx] / x[:, idx] / x[arange(B), -1]  (idx Global, global positions)
                              -> Global = all_reduce_sum(cat(x, zero row)[.., owned_rows[idx]])
    x (B, S/N, D) Sharded(1)  x[mask], mask (B, S) Global or Sharded(1) -> (n, D) Global: x[nonzero(mask)] as above
    x (B, S/N, D) Sharded(1)  gather / index_select / take_along_dim along 1, idx Global -> Global, the same way
    x (B, S/N, D) Sharded(1)  x[:, 1:5]       -> (B, S/N, D) Sharded(1, window=(1, 4)): the same local rows,
                                                 rows outside positions [1, 5) invalid (no copy, no gather)
    x.narrow(1, 1, 4)                         -> the same
    x[:, ::2], x[:, 1:] under a symbolic S  -> gather, then index (fallback, warned)
    x (B, S/N, D) Sharded(1)  x[:, perm], perm (S,) -> gather, then index: a read of S rows or more
                              holds the whole sequence on every rank anyway (fallback, warned)

A window (placements.py) is read only by the rules marked ``@window_aware`` (pointwise, per-token,
views keeping the dim, sum/mean, losses); the walk gathers it for any other op (rules/table.py).

Picking one position: the rank holding global position ``i`` contributes its row, every
other rank zeros, and the sum over the group is that row, exactly (a sum of one value
and zeros). The all-reduce's backward hands each rank the gradient of its share, so the
row's gradient lands on the rank that holds it. Bool values (which ``sum`` would turn
into integers) are gathered instead.

Reading positions chosen by data generalises this: each requested global position p becomes this
rank's local row of p, or row c of the shard extended by one zero row along the sequence when another
rank holds p; the same indexing op runs on the extended shard, and the sum over the group gives
every element from its owner, exactly; the gradient of each read row lands on its owner's row
(duplicates accumulate, as in one process). A boolean mask is read through its nonzero indices (a
size found by data); a per-token mask (``ids == eos``) is first made whole by one ``gather_stack``
of its bytes (logged at INFO, not a fallback: it holds no activations). Static S only.

Slicing a sequence input that every rank was passed whole (``inputs="full"``; labels
``idx[:, 1:]`` when the model reads its targets from the token ids) slices that whole
value: it costs nothing, and the result is Global.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx

from ...context import fake_value, global_shape, log, source_line
from ...fx_utils import reads_only_shape
from ...op_vocab import arguments
from ..placements import GLOBAL, Sharded
from .common import _flat_args
from .registry import chunk_aware, register_rule, window_aware


@chunk_aware
@window_aware
@register_rule(operator.getitem)
def getitem(em: Any, node: fx.Node):
    """``x[idx]`` with basic indexing: Sharded (a slice of the sequence dim: windowed)."""
    x, index = node.args
    s = em.layout(x)
    index = _expand_ellipsis(index if isinstance(index, tuple) else (index,), len(global_shape(x)))
    if index is None or any(isinstance(i, fx.Node) for i in index):
        if isinstance(s, Sharded) and s.chunk > 1:
            return em.fallback(node, "indexing the sequence's chunks with tensors")
        if any(em.windowed(a) for a in _flat_args(node)):
            return em.fallback(node, "indexing a slice of the sequence with tensors")
        looked_up = _table_lookup(em, node, index) if not isinstance(s, Sharded) else \
            _read_at(em, node, s, index) or _read_masked(em, node, s, index)
        return looked_up if looked_up is not None else em.fallback(node, "indexing with tensors on a sharded value")
    at, out_dim = seq_entry(index, s.dim)
    if at is not None:
        return _index_seq_dim(em, node, s, index, at, out_dim)
    return em.copy(node, (em.env[x], em.value(node.args[1])), {}), s.moved(out_dim)


def seq_entry(index: tuple, seq_dim: int) -> Tuple[Optional[int], int]:
    """Where a basic ``index`` (no ``...``) meets dim ``seq_dim`` of the indexed value: (the entry's
    position in ``index``, the dim it lands at in ``x[index]``), or (None, the dim ``seq_dim`` becomes)
    when the index ends before it."""
    in_dim, out_dim = 0, 0
    for at, i in enumerate(index):
        if i is None:
            out_dim += 1
            continue
        if in_dim == seq_dim:
            return at, out_dim
        out_dim += 0 if isinstance(i, int) else 1
        in_dim += 1
    return None, out_dim + seq_dim - in_dim


def _index_seq_dim(em: Any, node: fx.Node, s: Sharded, index: tuple, at: int, out_dim: int):
    """``x[index]`` whose entry ``index[at]`` falls on the sequence dim ``s.dim`` (it lands at ``out_dim``)."""
    x, i = node.args[0], index[at]
    if _covers(i, global_shape(x)[s.dim], em.ctx.seq_sym is not None):
        return em.copy(node, (em.env[x], em.value(node.args[1])), {}), s.moved(out_dim)
    if node.users and all(reads_only_shape(u) for u in node.users) and _one_row(i, global_shape(x)[s.dim]):
        # `zeros_like(x[:, 0])`, `zeros_like(x[:, :1])`: any local row has the shape; no row is fetched
        row = 0 if type(i) is int else i  # (an int: the first local row; the slice: its one row of the shard)
        local = tuple(em.value(index[j]) if j != at else row for j in range(len(index)))
        return em.copy(node, (em.env[x], local), {}), GLOBAL
    if s.chunk > 1:
        return em.fallback(node, f"slicing the sequence's chunks with {i!r}")
    if type(i) is int and s.inner == 1 and node.meta.get("example_value", None) is not None \
            and node.meta["example_value"].dtype is not torch.bool:
        return _pick_position(em, x, s, index, at, i), GLOBAL
    whole = em.whole_input(x)
    if whole is not None:  # every rank was passed this input whole: slice that, no communication
        return em.copy(node, (whole, em.value(node.args[1])), {}), GLOBAL
    window = _window(em, x, s, i)
    if window is None:
        return em.fallback(node, f"slicing the sequence dim with {i!r}")
    local_index = tuple(em.value(index[j]) if j != at else slice(None) for j in range(len(index)))
    return em.copy(node, (em.env[x], local_index), {}), Sharded(out_dim, 1, window)


@window_aware
@register_rule(torch.narrow, "narrow")
def narrow(em: Any, node: fx.Node):
    """``x.narrow(d, start, length)``: ``x[..., start:start + length]`` along d, as :func:`getitem` slices.

        x (B, S/N, D) Sharded(1)  x.narrow(1, 1, S - 1)  -> (B, S/N, D) Sharded(1, window=(1, S - 1))
        x (B, S/N, D) Sharded(1)  x.narrow(2, 0, 4)      -> (B, S/N, 4) Sharded(1)
    """
    a = arguments(node, ("input", "dim", "start", "length"))
    x, s = a["input"], em.layout(a["input"])
    dim, start, length = a.get("dim"), a.get("start"), a.get("length")
    if not isinstance(s, Sharded) or not all(type(v) is int for v in (dim, start, length)):
        return em.fallback(node, "narrow with bounds that are not ints")
    d = dim % len(global_shape(x))
    if d != s.dim:
        return em.copy(node, *em.value((node.args, node.kwargs))), s
    size = global_shape(x)[d]
    i = slice(start % size if start < 0 else start, (start % size if start < 0 else start) + length)
    if _covers(i, size, em.ctx.seq_sym is not None):
        return em.copy(node, *em.value((node.args, node.kwargs))), s
    window = _window(em, x, s, i)
    if window is None:
        return em.fallback(node, f"narrow of the sequence dim to {i!r}")
    return em.method("narrow", em.env[x], d, 0, em.ctx.padded_len // em.ctx.world), Sharded(d, 1, window)


def _window(em: Any, x: fx.Node, s: Sharded, i: Any) -> Optional[tuple]:
    """The window (a, n) of ``x[..., i]`` for a slice ``i`` of the sequence dim with int bounds and step 1
    (a window of a windowed x composes: its offset added), or None: a symbolic or runtime layout, merged
    tokens, a step, an empty slice (gathered instead)."""
    if not isinstance(i, slice) or not all(v is None or type(v) is int for v in (i.start, i.stop, i.step)) \
            or i.step not in (None, 1) or s.inner != 1 or em.index.runtime:
        return None
    a0, size = s.window if s.window is not None else (0, em.ctx.seq_len)
    if global_shape(x)[s.dim] != size:
        return None  # tokens merged with other dims along this one (B·S rows)
    r = range(size)[i]
    return (a0 + r.start, len(r)) if len(r) > 0 else None


def _table_lookup(em: Any, node: fx.Node, index: Optional[tuple]):
    """``table[..., ids, ...]``: a whole table read at sharded integer ids (RoPE's ``cos[position_ids]``).

    Each result row is the table's entry at that row's id, so this rank's ids give this rank's
    rows: the ids' sequence dim lands where the ids' dims are placed (at the first tensor index,
    every index before it a full slice), with the ids' ``inner`` (expert ids of the (token, slot)
    pairs, (B·S·k,) with inner k: HF's ``gate_up_proj[expert_ids]``). Several tensor indices must
    be sharded alike."""
    if index is None:
        return None
    ids = [(at, i) for at, i in enumerate(index) if isinstance(i, fx.Node)]
    lays = {em.layout(i) for _, i in ids}
    shapes = {global_shape(i) for _, i in ids}
    adjacent = [at for at, _ in ids] == list(range(ids[0][0], ids[0][0] + len(ids)))
    plain = all(i == slice(None) for i in index if not isinstance(i, fx.Node))
    lay = next(iter(lays))
    if len(lays) != 1 or len(shapes) != 1 or not adjacent or not plain or not isinstance(lay, Sharded) \
            or any(fake_value(i).dtype in (torch.bool, torch.uint8) for _, i in ids):
        return None
    return em.copy(node, (em.env[node.args[0]], em.value(node.args[1])), {}), Sharded(ids[0][0] + lay.dim, lay.inner)


def _pick_position(em: Any, x: fx.Node, s: Sharded, index: tuple, at: int, i: int) -> fx.Node:
    """``x[index]`` where ``index[at]`` is the int ``i`` on the sequence dim ``s.dim`` (see the module doc)."""
    from .... import graph_ops

    if s.window is not None:  # x[:, i] of a window (a, n): S-layout position a + i
        pos = s.window[0] + i % s.window[1]
    else:
        pos = i if i >= 0 else em.index.op(operator.add, em.index.S(), i)  # a global position in [0, S)
    nd = len(global_shape(x))
    mine = em.call(operator.eq, em.index.positions(em.ctx.group.rank), pos)  # (c,) bool: this rank holds i there
    mine = em.method("view", mine, *[-1 if d == s.dim else 1 for d in range(nd)])
    row = em.method("sum", em.call(torch.where, mine, em.env[x], 0), s.dim, True)  # size 1 along s.dim
    row = em.call(graph_ops.all_reduce_sum, row, em.ctx.group.name)  # Global: the row of position i
    return em.call(operator.getitem, row, index[:at] + (0,) + index[at + 1:])


def _one_row(i: Any, size: int) -> bool:
    """Whether index ``i`` along a dim of ``size`` picks one row: an int, or a slice one row long."""
    if type(i) is int:
        return True
    if not isinstance(i, slice) or any(v is not None and type(v) is not int for v in (i.start, i.stop, i.step)):
        return False
    return len(range(size)[i]) == 1


def _expand_ellipsis(index: tuple, ndim: int) -> Optional[tuple]:
    """``index`` with ``...`` replaced by full slices (x of rank ``ndim``); None for two ``...``."""
    n_ell = sum(1 for i in index if i is Ellipsis)
    if n_ell == 0:
        return index
    if n_ell > 1:
        return None
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    at = index.index(Ellipsis)
    return index[:at] + (slice(None),) * (ndim - used) + index[at + 1:]


def _covers(i: Any, size: int, symbolic: bool) -> bool:
    """Whether index ``i`` (an int, slice, ...) selects all ``size`` entries of a dim in order.

    Under a symbolic length only ``[:]`` / ``[0:]`` qualify: a literal bound equal to
    today's S would not cover tomorrow's.
    """
    if not isinstance(i, slice) or not all(v is None or type(v) is int for v in (i.start, i.stop, i.step)):
        return False  # tensor or symbolic bounds: not provably the whole dim
    if symbolic:
        return i.start in (None, 0) and i.stop is None and i.step in (None, 1)
    return range(size)[i] == range(size)


# ------------------------------------------------------------------------- reads at positions given by data
def _read_at(em: Any, node: fx.Node, s: Sharded, index: Optional[tuple]):
    """``x[arange(B), idx]`` / ``x[:, idx]``: the sequence dim of a Sharded x indexed by a Global integer
    tensor of global positions (negative ones wrapped by S): :func:`_owner_reads`. Else None."""
    x = node.args[0]
    if index is None or not _plain_seq(em, x, s) or fake_value(node).dtype is torch.bool or not _few_rows(em, node):
        return None
    tensors = [i for i in index if isinstance(i, fx.Node)]
    if any(em.layout(i) not in (None, GLOBAL) or fake_value(i).dtype in (torch.bool, torch.uint8) for i in tensors):
        return None  # a Sharded index, or a mask
    in_dim = 0
    for at, i in enumerate(index):
        if i is None:
            continue
        if in_dim == s.dim:
            if type(i) is int:  # logits[arange(B), -1]: this rank's row of position i, or the zero row
                local = int(_owned_table(em)[i % em.ctx.seq_len])
            elif isinstance(i, fx.Node):
                local = _owned_rows(em, em.env[i], wrap=True)
            else:
                return None
            new_index = tuple(em.value(j) if p != at else local for p, j in enumerate(index))
            return _owner_reads(em, x, s.dim, lambda ext: em.call(operator.getitem, ext, new_index)), GLOBAL
        in_dim += 1
    return None


def _read_masked(em: Any, node: fx.Node, s: Sharded, index: Optional[tuple]):
    """``x[mask]`` (also ``x[:, m]``): a boolean mask over dims of a Sharded x that include the sequence,
    held whole or Sharded alike (``ids == eos``: made whole on every rank by one small ``gather_stack``,
    logged at INFO: it holds no activations), read as ``x[nonzero(mask, as_tuple=True)]`` by
    :func:`_read_at`'s owner-contributes sum. The result's length is the mask's count (Dynamo's
    unbacked size). Else None."""
    x = node.args[0]
    tensors = [(at, i) for at, i in enumerate(index or ()) if isinstance(i, fx.Node)]
    if len(tensors) != 1 or not _plain_seq(em, x, s) or fake_value(node).dtype is torch.bool:
        return None
    at, mask = tensors[0]
    m, lay = len(global_shape(mask)), em.layout(mask)
    if fake_value(mask).dtype is not torch.bool or any(i != slice(None) for i in index[:at]) \
            or not at <= s.dim < at + m or global_shape(mask) != global_shape(x)[at:at + m]:
        return None
    if isinstance(lay, Sharded) and (lay.dim + at != s.dim or lay.inner != 1):
        return None
    whole = em.env[mask]
    if isinstance(lay, Sharded):  # a per-token mask: whole on every rank (m bytes a token), not a fallback
        from .order import stacked_whole

        log.info("cp_compile: the mask %s of %s at %s is made whole on every rank (gather_stack)", mask.name,
                 node.name, source_line(node))
        whole = em.method("bool", stacked_whole(em, em.method("to", whole, torch.uint8), lay.dim))
    found = em.call(torch.nonzero, whole, as_tuple=True)
    picks = [em.call(operator.getitem, found, j) for j in range(m)]
    picks[s.dim - at] = _owned_rows(em, picks[s.dim - at], wrap=False)
    new_index = tuple(em.value(index[:at])) + tuple(picks) + tuple(em.value(index[at + 1:]))
    return _owner_reads(em, x, s.dim, lambda ext: em.call(operator.getitem, ext, new_index)), GLOBAL


def _few_rows(em: Any, node: fx.Node) -> bool:
    """Whether the read's result is smaller than the sequence: no dim of S or more entries. A read of
    S positions or more (``x[:, perm]``, a reordering of every token) would hold the whole sequence on
    every rank, and costs more as a sum than as a gather: it is left to the fallback, which warns."""
    shape = fake_value(node).shape
    return not any(isinstance(n, int) and n >= em.ctx.seq_len for n in shape)


def _plain_seq(em: Any, x: fx.Node, s: Optional[Sharded]) -> bool:
    """Whether x's sequence dim is S rows of one token each, in a layout fixed at compile time."""
    return isinstance(s, Sharded) and s.inner == 1 and global_shape(x)[s.dim] == em.ctx.seq_len \
        and not em.index.runtime


def _owned_rows(em: Any, idx: fx.Node, wrap: bool) -> fx.Node:
    """Global positions ``idx`` mapped to this rank's local rows, c (one past the last row) where
    another rank holds the position: ``table[p]``, the table (S,) a constant of this rank."""
    table = em.const(f"_cp_owned_rows{em.ctx.group.rank}_{em.ctx.seq_len}", _owned_table(em))
    if wrap:  # x[:, -1] with a tensor: position S - 1
        idx = em.call(torch.where, em.call(operator.lt, idx, 0), em.call(operator.add, idx, em.ctx.seq_len), idx)
    return em.call(operator.getitem, table, idx)


def _owned_table(em: Any) -> torch.Tensor:
    """(S,) int64: this rank's local row of each global position, c where another rank holds it."""
    from ....sequence import rank_positions

    s, c = em.ctx.seq_len, em.ctx.padded_len // em.ctx.world
    pos = rank_positions(em.ctx.padded_len, em.ctx.world, em.ctx.group.rank, em.ctx.options.load_balance)
    table, real = torch.full((s,), c, dtype=torch.int64), pos < s
    table[pos[real]] = torch.arange(c)[real]
    return table


def _owner_reads(em: Any, x: fx.Node, d: int, read: Any) -> fx.Node:
    """``read`` (the op with its index mapped by :func:`_owned_rows`) on this rank's rows of x with a zero
    row appended along d, summed over the group: the owner of each position gives its row, the others
    zeros, exactly; the sum's backward lands each row's gradient on its owner."""
    from .... import graph_ops

    key = ("owner_reads", x, d)
    if key not in em._memo:  # (..., c + 1, ...): row c reads as zeros
        local = em.env[x]
        em._memo[key] = em.call(torch.cat, [local, em.call(torch.zeros_like, em.method("narrow", local, d, 0, 1))], d)
    return em.call(graph_ops.all_reduce_sum, read(em._memo[key]), em.ctx.group.name)


@register_rule(torch.gather, "gather", torch.index_select, "index_select", torch.take_along_dim, "take_along_dim")
def read_along(em: Any, node: fx.Node):
    """``torch.gather(x, d, idx)`` / ``index_select(x, d, idx)`` / ``take_along_dim(x, idx, d)`` along the
    sequence dim of a Sharded x with a Global integer idx of positions: :func:`_owner_reads` -> Global.
    Any other form is the oracle's (per token along other dims), else gathered."""
    from .order import _unruled

    x = node.args[0]
    a = arguments(node, ("input", "dim", "index"))
    idx, dim = a.get("index", a.get("indices")), a.get("dim")
    s = em.layout(x)
    if not (_plain_seq(em, x, s) and isinstance(dim, int) and dim % len(global_shape(x)) == s.dim
            and isinstance(idx, fx.Node) and em.layout(idx) in (None, GLOBAL) and _few_rows(em, node)):
        return _unruled(em, node, f"{node.target if isinstance(node.target, str) else node.target.__name__} "
                        "with indices that are not whole positions along the sequence")
    local = _owned_rows(em, em.env[idx], wrap=False)
    named = {"dim": dim, ("indices" if "indices" in a else "index"): local}
    return _owner_reads(em, x, s.dim, lambda ext: em.copy(node, (ext,), {**_rest(a), **named})), GLOBAL


def _rest(a: dict) -> dict:
    return {k: v for k, v in a.items() if k not in ("input", "dim", "index", "indices") and v is not None}
