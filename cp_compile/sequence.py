"""Load-balanced sequence layouts: which global tokens each CP rank holds.

A layout maps a sequence of ``S`` tokens onto ``N`` ranks, each holding
``c = S / N`` tokens in increasing global order:

| layout       | rank r holds                                  | S must divide by |
|--------------|-----------------------------------------------|------------------|
| ``zigzag``   | chunks r and 2N-1-r of 2N equal chunks        | 2N (1 if N == 1) |
| ``striped``  | tokens r, r+N, r+2N, ...                      | N                |
| ``contiguous`` | tokens [r*c, (r+1)*c)                       | N                |
| ``documents``  | row r of a per-batch table (below)            | N                |

A layout may also be given as a **table** of positions, computed per batch (e.g. the
document-aware :func:`cp_compile.document_layout.layout_table`): an (N, c) int64 tensor whose
row r lists rank r's global positions, sorted increasing, the rows together a partition
of range(N·c), the same whole tensor on every rank (:func:`check_table`). It replaces
``load_balance`` wherever it is passed (``positions=table``). One table serves the whole
batch: every batch row is laid out the same way.

Public helpers: :func:`shard` (full tensor -> this rank's tokens), :func:`unshard`
(all-gather + inverse permutation, differentiable) and :func:`positions` (global
positions of this rank's tokens). ``group=None`` is the default process group, or a
single rank when torch.distributed is not initialised.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .group import resolve_group
from .options import LOAD_BALANCES, check_choice


def split_multiple(world_size: int, load_balance: str) -> int:
    """The number the sequence length must divide by for ``load_balance`` on ``world_size`` ranks."""
    check_choice("load_balance", load_balance, LOAD_BALANCES)
    if world_size == 1:  # one rank holds everything: nothing to split
        return 1
    return 2 * world_size if load_balance == "zigzag" else world_size


def check_seq_len(seq_len: int, world_size: int, load_balance: str) -> None:
    """Raise a ValueError naming the required multiple if ``seq_len`` cannot be split."""
    multiple = split_multiple(world_size, load_balance)
    if seq_len <= 0 or seq_len % multiple != 0:
        raise ValueError(
            f"cp_compile: sequence length {seq_len} cannot be split by the {load_balance!r} "
            f"layout over {world_size} ranks: it must be a positive multiple of {multiple}. "
            f"Fix: pad the sequence to a multiple of {multiple}."
        )


def rank_positions(seq_len: int, world_size: int, rank: int, load_balance: str) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens ``rank`` holds. Pure: no group needed."""
    check_seq_len(seq_len, world_size, load_balance)
    if load_balance == "documents":
        raise ValueError(
            "cp_compile: load_balance='documents' has no fixed positions: the layout is computed per batch. "
            "Fix: pass positions=cp_compile.layout_table(doc_ids, N) (cp_compile.shard / unshard / positions, "
            "ring_attention), or use load_balance='zigzag'.")
    if not 0 <= rank < world_size:
        raise ValueError(f"cp_compile: rank {rank} is outside a group of size {world_size}.")
    c = seq_len // world_size
    if load_balance == "contiguous":
        return torch.arange(rank * c, (rank + 1) * c)
    if load_balance == "striped":
        return torch.arange(rank, seq_len, world_size)
    if world_size == 1:
        return torch.arange(seq_len)
    h = c // 2  # zigzag chunk
    first = torch.arange(rank * h, (rank + 1) * h)
    second = torch.arange((2 * world_size - 1 - rank) * h, (2 * world_size - rank) * h)
    return torch.cat([first, second])


def _table_error(what: str, fix: str) -> None:
    raise ValueError(f"cp_compile: the positions table {what}. Fix: {fix}")


_TABLE_FIX = ("build it with cp_compile.document_layout.layout_table(doc_lengths, N) "
              "(one table serves the whole batch: build it from the union of the rows' document boundaries, "
              "or use B = 1)")


def check_table(table: Any, world_size: int, seq_len: Optional[int] = None) -> torch.Tensor:
    """``table`` checked as a layout of ``seq_len`` (if given) tokens over ``world_size`` ranks: (N, c) int64,
    rows sorted strictly increasing, together a partition of range(N·c). Returns it on the CPU."""
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int64:
        what = table.dtype if isinstance(table, torch.Tensor) else type(table).__name__
        _table_error(f"must be an int64 tensor, got {what}", f"pass table.long(); {_TABLE_FIX}.")
    if table.dim() != 2 or table.shape[0] != world_size or table.shape[1] == 0:
        _table_error(f"has shape {tuple(table.shape)}; expected (N={world_size}, S/N): one row of global "
                     "positions per rank of the group", f"pass the whole table (not table[rank]); {_TABLE_FIX}.")
    n, c = table.shape
    if seq_len is not None and n * c != seq_len:
        _table_error(f"lays out {n * c} tokens but the sequence has {seq_len}",
                     f"build the table for this sequence's length (pad it to a multiple of {n}); {_TABLE_FIX}.")
    t = table.detach().cpu()
    if c > 1 and not bool((t[:, 1:] > t[:, :-1]).all()):
        _table_error("has a row that is not sorted strictly increasing (the ring needs each rank's tokens in "
                     "global order)", "sort each row: table = table.sort(dim=1).values.")
    flat = t.reshape(-1)
    if int(flat.min()) < 0 or int(flat.max()) >= n * c or bool((torch.bincount(flat, minlength=n * c) != 1).any()):
        _table_error(f"is not a partition of range({n * c}): some position is missing, repeated or out of range",
                     f"give every position 0..{n * c - 1} to exactly one rank; {_TABLE_FIX}.")
    return t


def _rank_table_positions(seq_len: int, g: Any, load_balance: str, table: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's positions: ``table[rank]`` (checked) if a table is given, else by ``load_balance``."""
    if table is None:
        return rank_positions(seq_len, g.size, g.rank, load_balance)
    return check_table(table, g.size, seq_len)[g.rank]


def positions(seq_len: int, *, group: Any = None, load_balance: str = "zigzag",
              positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Global positions of this rank's tokens for a sequence of ``seq_len`` (LongTensor, shape (S/N,)).

    ``positions``: an (N, S/N) table (module docstring): the result is its row for this rank.
    """
    return _rank_table_positions(seq_len, resolve_group(group), load_balance, positions)


def _normalise_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"cp_compile: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.dim()


def shard(x: torch.Tensor, dim: int, *, group: Any = None, load_balance: str = "zigzag",
          positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` along ``dim`` (differentiable).

    Every rank passes the same full tensor; the result has ``x.shape[dim] / N`` entries
    along ``dim``, in increasing global order (see :func:`positions`). ``positions``: a
    table (module docstring) in place of ``load_balance``.
    """
    dim = _normalise_dim(x, dim)
    g = resolve_group(group)
    pos = _rank_table_positions(x.shape[dim], g, load_balance, positions)
    if g.size == 1:
        return x
    return x.index_select(dim, pos.to(x.device))


def unshard(x_local: torch.Tensor, dim: int, *, group: Any = None, load_balance: str = "zigzag",
            positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full tensor on every rank from each rank's shard along ``dim`` (differentiable).

    All-gathers the shards (the backward is a reduce-scatter, so a loss computed on the
    full tensor gives each rank the gradient of its own shard) and undoes the layout's
    permutation (``positions``: a table, in place of ``load_balance``).
    """
    dim = _normalise_dim(x_local, dim)
    g = resolve_group(group)
    seq_len = x_local.shape[dim] * g.size
    if positions is not None:
        order = check_table(positions, g.size, seq_len).reshape(-1)
    elif g.size > 1:
        order = torch.cat([rank_positions(seq_len, g.size, r, load_balance) for r in range(g.size)])
    if g.size == 1:
        return x_local
    from torch.distributed._functional_collectives import all_gather_single_autograd

    # Gather along dim 0 (the one all functional-collective backends support), rank-major.
    gathered = all_gather_single_autograd(x_local.movedim(dim, 0).contiguous(), 0, g.pg)
    inverse = torch.argsort(order).to(x_local.device)
    return gathered.index_select(0, inverse).movedim(0, dim).contiguous()  # like the full tensor it stands for
