"""``associative_scan`` along the sequence: the whole scan, and each rank's share of it from run totals.

torch's ``associative_scan(combine_fn, xs, dim)`` computes, for every position t, the combine of
elements 0..t (``combine(left, right)``: left the earlier part). The graph pass
:mod:`cp_compile.passes.normalize.assoc_scan` turns each call Dynamo traced into one node calling
:func:`scan_leaves` with the combine as an FX module; under CP the rule
(``passes/propagate/rules/assoc_scan.py``) replaces it by :func:`sharded_scan`:

    leaves: this rank's k runs of L tokens along dim 0                       # (k·L, ...) each
    s_j = scan of run j alone                                                # (L, ...): all ranks at once
    totals = gather_stack(s_j[-1] for every run)                             # (N, k, |total|): one collective
    p_g = combine of the totals of global runs 0..g-1, in global order       # a loop over N·k small values
    out_j = combine(p_g expanded along the run, s_j)   (s_j itself for g = 0)
    -> cat(out_j) per leaf                                                   # (k·L, ...)

Exact for any associative combine (the same function is applied, only grouped differently, as
torch's own tree scan does), with O(N · k · |total|) bytes per call, independent of S. Gradients are
autograd's, through the combine and ``gather_stack`` (a reduce-scatter backward); the gathered
totals are tied into each of this rank's floating outputs (``keep_alive``), so every rank runs that
backward even when none of its runs reads another rank's totals (rank 0, contiguous: a hang otherwise).

``batched=True``: the combine takes single elements (``combine_mode="generic"``) and is vmapped over
dim 0; ``batched=False``: it is pointwise and applied to whole runs (the higher-order op's form).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch._higher_order_ops.associative_scan import generic_associative_scan

from ..graph_ops import gather_stack
from .state_passing import keep_alive

Tensor = torch.Tensor


def _operator(combine: Callable, leaves: int, extra: int, batched: bool) -> Callable:
    """``combine(*left, *right, *extra) -> leaves`` applied to whole runs along dim 0."""
    if not batched:
        return combine
    return torch.vmap(combine, in_dims=(0,) * (2 * leaves) + (None,) * extra, out_dims=0)


def _flat(values) -> List[Tensor]:
    return list(values) if isinstance(values, (tuple, list)) else [values]


def scan_leaves(combine: Callable, leaves: Sequence[Tensor], additional: Sequence[Tensor] = (),
                batched: bool = True) -> List[Tensor]:
    """The inclusive scan of ``leaves`` along dim 0 (torch's tree algorithm): one list of leaves."""
    op = _operator(combine, len(leaves), len(additional), batched)
    return list(generic_associative_scan(lambda *a: _flat(op(*a)), list(leaves), 0, tuple(additional)))


def sharded_scan(combine: Callable, leaves: Sequence[Tensor], additional: Sequence[Tensor], *, runs: int,
                 order: Sequence[Tuple[int, int]], rank: int, world: int, group_name: str,
                 batched: bool = True) -> List[Tensor]:
    """This rank's share of the scan (module docstring): ``leaves`` are its ``runs`` runs along dim 0,
    ``order`` is (rank, run) of every run of the sequence in global order."""
    n = len(leaves)
    op = _operator(combine, n, len(additional), batched)
    pieces = [[x.unflatten(0, (runs, -1))[j] for x in leaves] for j in range(runs)]  # runs × n of (L, ...)
    scanned = [scan_leaves(combine, p, additional, batched) for p in pieces]
    totals, stacked = _gathered_totals(scanned, world, group_name)  # (N, k) grid of n leaves each
    running: Optional[List[Tensor]] = None
    prefix: List[Optional[List[Tensor]]] = [None] * runs
    for r, j in order:
        if r == rank:
            prefix[j] = running
        t = totals[r][j]
        running = t if running is None else _flat(op(*running, *t, *additional))
    outs = [s if p is None else _flat(op(*[q.expand_as(x) for q, x in zip(p, s)], *s, *additional))
            for p, s in zip(prefix, scanned)]
    result = [torch.cat([o[i] for o in outs], 0) for i in range(n)]
    for part in stacked:  # every rank runs the gathers' backward, whichever outputs the model reads
        if part.is_floating_point():
            result = [keep_alive(x, part) if x.is_floating_point() else x for x in result]
    return result


def _gathered_totals(scanned: List[List[Tensor]], world: int,
                     group_name: str) -> Tuple[List[List[List[Tensor]]], List[Tensor]]:
    """Every run's total (its scan's last element, (1, ...) per leaf) from every rank: ``[rank][run]``
    lists of leaves, and the gathered stacks (one ``gather_stack`` per dtype among the leaves)."""
    runs, n = len(scanned), len(scanned[0])
    last = [[s[i][-1:] for i in range(n)] for s in scanned]  # runs × n of (1, ...)
    dtypes = sorted({x.dtype for x in last[0]}, key=str)
    grid: List[List[List[Optional[Tensor]]]] = [[[None] * n for _ in range(runs)] for _ in range(world)]
    stacks: List[Tensor] = []
    for dtype in dtypes:
        which = [i for i in range(n) if last[0][i].dtype == dtype]
        packed = torch.stack([torch.cat([last[j][i].reshape(-1) for i in which]) for j in range(runs)])  # (k, w)
        stacked = gather_stack(packed, world, group_name)  # (N, k, w), the same on every rank
        stacks.append(stacked)
        for r in range(world):
            for j in range(runs):
                at = 0
                for i in which:
                    size = last[j][i].numel()
                    grid[r][j][i] = stacked[r, j, at:at + size].view(last[j][i].shape)
                    at += size
    return grid, stacks  # type: ignore[return-value]


def total_bytes(leaves: Sequence[Tensor], runs: int, world: int) -> int:
    """Bytes every rank receives in the totals' all-gather: N·k totals of one element per leaf."""
    per = sum(x[0].numel() * x.element_size() for x in leaves)
    return world * runs * per


__all__ = ["scan_leaves", "sharded_scan", "total_bytes"]
