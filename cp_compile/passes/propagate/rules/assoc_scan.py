"""Layout rule for ``associative_scan`` along the sequence: run totals, one all-gather, never a gather.

    outs = scan_leaves(combine, [x_i (S, ...) Sharded(0)], [extra Global])      # normalize/assoc_scan.py
    -> outs = sharded_scan(combine, [x_i local (k·L, ...)], [extra], runs=k, order=...)   Sharded(0) each
    outs = scan_leaves(combine, [x_i (T, ..., S, ...) Sharded(d), d > 0], ...)   -> the same node, Sharded(d)

Each rank scans its k runs alone, one ``gather_stack`` brings every run's total (one element per
leaf), and each run is combined with the totals of the runs before it in *global* order (zig-zag
runs are not contiguous): :mod:`cp_compile.recurrence.scan`. Padding rows (a length that is not a
multiple of N·k) follow every real token, so no real token reads them; they are set to a real row of
the same rank (finite values: no NaN in the combine's backward through them).

Gathered instead (warned, exact): a layout with no fixed runs (``striped`` on several ranks,
``documents``), a symbolic S, a leaf split along another dim than the scan's (or merged with other
dims), and a combine that closes over a value split by sequence.
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
import torch.fx as fx

from ....recurrence.scan import scan_leaves, sharded_scan, total_bytes
from ....recurrence.spec import StatePassed
from ...context import global_shape, log, source_line
from ...fx_utils import fake_value
from ..emitter import Emitter
from ..placements import Sharded
from .common import _no_runs
from .registry import register_rule


@register_rule(scan_leaves)
def associative_scan(em: Emitter, node: fx.Node):
    """``scan_leaves`` of Sharded(0) leaves on this rank's runs (see the module docstring)."""
    combine, leaves, extra = node.args[:3]
    across = _across_tokens(em, leaves, extra)
    if across is not None:  # a scan along another dim than the sequence: each token's own
        return em.copy(node, *em.value((node.args, node.kwargs))), tuple(across for _ in leaves)
    why = _refusal(em, leaves, extra)
    if why is not None:
        return em.fallback(node, f"associative_scan: {why}")
    table, _ = em.index.chunks()
    k = table.shape[1]
    order = sorted((int(table[r, j]), r, j) for r in range(table.shape[0]) for j in range(k))
    local = [_local(em, x) for x in leaves]
    new = em.call(sharded_scan, em.env[combine], local, [em.env[a] for a in extra], runs=k,
                  order=[(r, j) for _, r, j in order], rank=em.ctx.group.rank, world=em.ctx.world,
                  group_name=em.ctx.group.name, batched=node.kwargs.get("batched", True))
    _record(em, node, leaves, k)
    return tuple(em.call(operator.getitem, new, i) for i in range(len(leaves))), tuple(Sharded(0) for _ in leaves)


def _across_tokens(em: Emitter, leaves: List[fx.Node], extra: List[fx.Node]) -> Optional[Sharded]:
    """The leaves' layout when every leaf is split along one dim other than the scanned dim 0 (and the
    combine reads nothing split): the scan is then per token. Else None."""
    lays = {em.layout(x) for x in leaves}
    if len(lays) != 1 or any(isinstance(em.layout(a), Sharded) for a in extra):
        return None
    lay = lays.pop()
    ok = isinstance(lay, Sharded) and lay.dim != 0 and lay.window is None
    return lay if ok else None


def _refusal(em: Emitter, leaves: List[fx.Node], extra: List[fx.Node]) -> Optional[str]:
    """Why the scan cannot be done from run totals here, or None."""
    why = _no_runs(em)
    if why is not None:
        return why
    for x in leaves:
        lay = em.layout(x)
        if global_shape(x)[0] != em.ctx.seq_len:
            return f"it scans {global_shape(x)[0]} entries, not the sequence's {em.ctx.seq_len} tokens"
        if isinstance(lay, Sharded) and (lay.dim != 0 or lay.inner != 1 or lay.window is not None):
            return (f"a leaf is split along dim {lay.dim} (inner {lay.inner}) while the scan runs along dim 0 "
                    "(fix: scan along the sequence dim of a view that keeps the tokens as a dim of their own)")
    if any(isinstance(em.layout(a), Sharded) for a in extra):
        return "its combine function reads a value split by sequence (fix: pass it as one of the scanned xs)"
    return None


def _local(em: Emitter, x: fx.Node) -> fx.Node:
    """``x``'s local rows along dim 0 (indexed if whole), padding rows set to this rank's first row."""
    local = em.env[x] if isinstance(em.layout(x), Sharded) else em.to_sharded(x, 0)
    mask = em.valid_mask(x, local, 0, 1)
    return local if mask is None else em.call(torch.where, mask, local, em.method("narrow", local, 0, 0, 1))


def _record(em: Emitter, node: fx.Node, leaves: List[fx.Node], runs: int) -> None:
    """What explain and the record say of this scan."""
    values: List[Any] = [fake_value(x) for x in leaves]
    sent = total_bytes(values, runs, em.ctx.world)
    state = tuple(int(s) for s in values[0].shape[1:])
    entry = StatePassed(node=node.name, kernel="associative_scan", where=source_line(node), transition="scan",
                        state=state, runs=runs, bytes=sent)
    em.ctx.state_passed.append(entry)
    log.info("cp_compile: associative_scan at %s split by run totals (%d leaves, element %s, %d B per rank)",
             entry.where, len(leaves), state, sent)
