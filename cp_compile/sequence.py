"""Load-balanced sequence layouts: which global tokens each CP rank holds.

A layout maps a sequence of ``S`` tokens onto ``N`` ranks, each holding
``c = S / N`` tokens in increasing global order:

| layout       | rank r holds                                  | S must divide by |
|--------------|-----------------------------------------------|------------------|
| ``zigzag``   | chunks r and 2N-1-r of 2N equal chunks        | 2N (1 if N == 1) |
| ``striped``  | tokens r, r+N, r+2N, ...                      | N                |
| ``contiguous`` | tokens [r*c, (r+1)*c)                       | N                |

Public helpers: :func:`shard` (full tensor -> this rank's tokens), :func:`unshard`
(all-gather + inverse permutation, differentiable) and :func:`positions` (global
positions of this rank's tokens). ``group=None`` is the default process group, or a
single rank when torch.distributed is not initialised.
"""

from __future__ import annotations

from typing import Any

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


def positions(seq_len: int, *, group: Any = None, load_balance: str = "zigzag") -> torch.Tensor:
    """Global positions of this rank's tokens for a sequence of ``seq_len`` (LongTensor, shape (S/N,))."""
    g = resolve_group(group)
    return rank_positions(seq_len, g.size, g.rank, load_balance)


def _normalise_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"cp_compile: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.dim()


def shard(x: torch.Tensor, dim: int, *, group: Any = None, load_balance: str = "zigzag") -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` along ``dim`` (differentiable).

    Every rank passes the same full tensor; the result has ``x.shape[dim] / N`` entries
    along ``dim``, in increasing global order (see :func:`positions`).
    """
    dim = _normalise_dim(x, dim)
    g = resolve_group(group)
    pos = rank_positions(x.shape[dim], g.size, g.rank, load_balance)
    if g.size == 1:
        return x
    return x.index_select(dim, pos.to(x.device))


def unshard(x_local: torch.Tensor, dim: int, *, group: Any = None, load_balance: str = "zigzag") -> torch.Tensor:
    """The full tensor on every rank from each rank's shard along ``dim`` (differentiable).

    All-gathers the shards (the backward is a reduce-scatter, so a loss computed on the
    full tensor gives each rank the gradient of its own shard) and undoes the layout's
    permutation.
    """
    dim = _normalise_dim(x_local, dim)
    g = resolve_group(group)
    if g.size == 1:
        return x_local
    from torch.distributed._functional_collectives import all_gather_single_autograd

    # Gather along dim 0 (the one all functional-collective backends support), rank-major.
    gathered = all_gather_single_autograd(x_local.movedim(dim, 0).contiguous(), 0, g.pg)
    seq_len = x_local.shape[dim] * g.size
    order = torch.cat([rank_positions(seq_len, g.size, r, load_balance) for r in range(g.size)])
    inverse = torch.argsort(order).to(x_local.device)
    return gathered.index_select(0, inverse).movedim(0, dim).contiguous()  # like the full tensor it stands for
