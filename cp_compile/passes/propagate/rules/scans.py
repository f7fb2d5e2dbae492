"""Layout rule for scans along the sequence: cumsum, cumprod, logcumsumexp, cummax, cummin (docs/design.md §6).

    x (B, S/N, D) Sharded(1)  x.cumsum(1)  -> (B, S/N, D) Sharded(1), exact, no gather of x:
        runs = x.unflatten(1, (k, L))                       # (B, k, L, D): this rank's k contiguous runs
        y = runs.cumsum(2)                                  # each run scanned alone
        totals = gather_stack(y[:, :, -1])                  # (N, B, k, D): every run's total, O(B·D) per run
        prefix = exclusive cumsum of totals in global chunk order, picked at this rank's chunks   # (B, k, D)
        out = (prefix[:, :, None] + y).flatten(1, 2)        # (B, S/N, D)
    x.cumsum(-1) (not along the sequence)                   -> Sharded(1), per token
    x.cummax(1) -> (values, indices) both Sharded(1): indices are global positions, torch's tie rule kept

The layout as runs is :meth:`SeqIndex.chunks`: rank r's local tokens are k runs of L tokens, run j
covering global chunk ``table[r, j]``. Every scan here is an associative combine ⊕ (sum, product,
logaddexp, max/min with the position of the winner), so the scan at a token of chunk g is
(⊕ of the totals of chunks 0..g-1) ⊕ (the scan of its run up to the token). Padding rows (positions >= S,
only ever after the real tokens) are set to ⊕'s identity first, so they add nothing and their gradient is
zero. The gradient is autograd's through these ops and ``gather_stack`` (a reduce-scatter backward).

cummax/cummin: torch returns the *last* index among equal values (``x >= best`` for cummax, ``<=`` for
cummin) and a NaN wins from where it occurs, each later NaN taking over the index. The combine keeps that:
the local running value wins over the prefix when ``local >= prefix`` (``<=``) or it is NaN. The totals'
global positions travel bit-cast into the values' dtype in the same ``gather_stack`` (one collective).

Gathered (warned) instead: ``load_balance="striped"`` on several ranks and ``"documents"`` (no fixed
contiguous runs), a sequence dim merged with other dims (``inner`` != 1, tokens flattened with the batch),
``out=``, and cummax/cummin of bool values.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx

from ....graph_ops import gather_stack
from ...context import global_shape
from ...fx_utils import fake_value
from ...op_vocab import arguments
from ..emitter import Emitter
from ..placements import Sharded
from .common import _name, _ndim, _norm, _sharded
from .registry import chunk_aware, register_rule

_SCANS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod, "logcumsumexp": torch.logcumsumexp,
          "cummax": torch.cummax, "cummin": torch.cummin}
_COMBINE = {"cumsum": operator.add, "cumprod": operator.mul, "logcumsumexp": torch.logaddexp}


@chunk_aware  # a scan over chunks is the same from run totals: each run is a whole number of chunks
@register_rule(*_SCANS.values(), *_SCANS)
def scan(em: Emitter, node: fx.Node):
    """A scan of a Sharded value: along another dim per token; along the sequence from every rank's run
    totals (one ``gather_stack``); gathered when the layout has no contiguous runs (see the module doc)."""
    name = _name(node)
    a = arguments(node, ("input", "dim", "dtype"))
    x = a["input"]
    s = _sharded(em, x)
    outs = 2 if name in ("cummax", "cummin") else 1
    if s is None or "out" in a and a["out"] is not None:
        return em.fallback(node, f"{name} with out= or of a value not split by sequence")
    if _norm(a["dim"], _ndim(x)) != s.dim:  # along the features: each token's row alone
        lay = Sharded(s.dim, s.inner, chunk=s.chunk)
        return em.copy(node, *em.value((node.args, node.kwargs))), (lay if outs == 1 else (lay, lay))
    why = _refusal(em, x, s, name)
    if why is not None:
        return em.fallback(node, f"{name} along the sequence dim: {why}")
    local = _masked(em, x, s.dim, _identity(name, fake_value(x).dtype))
    table, length = em.index.chunks()
    k, d = table.shape[1], s.dim
    result = fake_value(node)
    dtype = (result[0] if isinstance(result, (tuple, list)) else result).dtype  # the scan's values' dtype
    runs = em.method("unflatten", local, d, (k, -1))  # (..., k, L, ...): this rank's runs
    kwargs = {"dtype": a["dtype"]} if a.get("dtype") is not None else {}
    scanned = em.call(_SCANS[name], runs, d + 1, **kwargs)  # each run alone
    if outs == 1:
        prefix = _exclusive_prefix(em, name, _totals(em, scanned, d, dtype)[0], table, d, dtype)
        out = em.call(_COMBINE[name], em.method("unsqueeze", prefix, d + 1), scanned)  # (..., k, L, ...)
        return _result(em, node, out, d, result), Sharded(d, chunk=s.chunk)
    values, indices = _cummaxmin(em, name, scanned, (table, length), _ndim(x) + 1, d, dtype)
    return (_result(em, node, values, d, result[0], "_values"),
            _result(em, node, indices, d, result[1], "_indices")), (Sharded(d), Sharded(d))


def _result(em: Emitter, node: fx.Node, runs: fx.Node, d: int, value: Any, suffix: str = "") -> fx.Node:
    """(..., k, L, ...) -> (..., c, ...), named after the scan and carrying its global value (for explain);
    cummax/cummin: a tuple of two of these, which the walk indexes as Python values."""
    new = em.graph.create_node("call_method", "flatten", (runs, d, d + 1), {}, name=node.name + suffix)
    new.meta = {**node.meta, "example_value": value}
    return new


def _refusal(em: Emitter, x: fx.Node, s: Sharded, name: str) -> Optional[str]:
    """Why a scan along the sequence of ``x`` cannot be done from run totals, or None."""
    if em.index.chunks() is None:
        return (f"load_balance={em.ctx.options.load_balance!r} on {em.ctx.world} ranks holds no contiguous runs "
                "of tokens to scan (fix: load_balance='zigzag' or 'contiguous')")
    if name in ("cummax", "cummin") and s.chunk > 1:
        return f"{name} over chunks of the sequence (its indices are positions; fix: scan the tokens' view)"
    if s.inner != 1 or global_shape(x)[s.dim] != em.ctx.seq_len // s.chunk:
        return ("the sequence is merged with other dims there (tokens flattened with the batch or the features); "
                "fix: scan a view with the sequence as a dim of its own")
    if name in ("cummax", "cummin") and fake_value(x).dtype is torch.bool:
        return "cummax/cummin of bool values (fix: cast them to an integer type first)"
    return None


def _identity(name: str, dtype: torch.dtype) -> Any:
    """The scan's identity in ``dtype``: what padding rows are set to."""
    if name in ("cumsum", "cumprod"):
        one = name == "cumprod"
        return one if dtype is torch.bool else (int(one) if not dtype.is_floating_point else float(one))
    if name == "logcumsumexp":
        return float("-inf")
    low = name == "cummax"  # cummax: the lowest value; cummin: the highest
    if dtype.is_floating_point:
        return float("-inf") if low else float("inf")
    info = torch.iinfo(dtype)
    return info.min if low else info.max


def _masked(em: Emitter, x: fx.Node, dim: int, identity: Any) -> fx.Node:
    """``x``'s local value with padding rows set to ``identity`` (padding follows every real token)."""
    mask = em.valid_mask(x, em.env[x], dim, 1)
    return em.env[x] if mask is None else em.call(torch.where, mask, em.env[x], identity)


def _totals(em: Emitter, scanned: fx.Node, d: int, dtype: torch.dtype,
            index: Optional[fx.Node] = None) -> Tuple[fx.Node, ...]:
    """Every rank's run totals (the last entry of each run's scan), in global chunk order: (..., N·k, ...).
    With ``index`` (cummax/cummin: the totals' global positions) both travel in one ``gather_stack``,
    the int64 positions bit-cast into the values' dtype along an extra last dim."""
    last = em.call(torch.select, scanned, d + 1, -1)  # (..., k, ...)
    packed = last
    if index is not None:  # an int64 is 8 // itemsize values of dtype: (..., k, ..., w)
        bits = em.method("view", em.method("unsqueeze", index, -1), dtype)
        packed = em.call(torch.cat, [em.method("unsqueeze", last, -1), bits], -1)
    stacked = em.call(gather_stack, packed, em.ctx.world, em.ctx.group.name)  # (N, ..., k, ...[, 1 + w])
    parts = [stacked] if index is None else [
        em.call(torch.select, stacked, -1, 0),
        em.method("squeeze", em.method("view", em.method("contiguous", em.method(
            "detach", em.call(operator.getitem, stacked, (Ellipsis, slice(1, None))))), torch.int64), -1)]
    return tuple(_global_order(em, p, d) for p in parts)


def _global_order(em: Emitter, stacked: fx.Node, d: int) -> fx.Node:
    """(N, ..., k, ...) rank-major run totals -> (..., N·k, ...) in global chunk order."""
    table, _ = em.index.chunks()
    flat = em.method("flatten", em.method("movedim", stacked, 0, d), d, d + 1)  # entry r·k + j: rank r's run j
    perm = torch.argsort(table.reshape(-1))  # global chunk g is entry perm[g]
    if torch.equal(perm, torch.arange(perm.numel())):
        return flat
    return em.method("index_select", flat, d, em.const(f"_cp_scan_order_{table.shape[1]}", perm))


def _exclusive_prefix(em: Emitter, name: str, totals: fx.Node, table: torch.Tensor, d: int,
                      dtype: torch.dtype) -> fx.Node:
    """For each of this rank's runs, the combine of the totals of every chunk before it: (..., k, ...)."""
    inclusive = em.call(_SCANS[name], totals, d)  # (..., N·k, ...)
    shifted = _shift(em, inclusive, d, table.numel(), _identity(name, dtype))
    return em.method("index_select", shifted, d, _mine(em, table))


def _shift(em: Emitter, inclusive: fx.Node, d: int, chunks: int, identity: Any) -> fx.Node:
    """The inclusive scan over the chunks moved one chunk later, the identity first: the exclusive scan."""
    first = em.call(torch.full_like, em.method("narrow", inclusive, d, 0, 1), identity)
    return em.call(torch.cat, [first, em.method("narrow", inclusive, d, 0, chunks - 1)], d)


def _mine(em: Emitter, table: torch.Tensor) -> fx.Node:
    rank = em.ctx.group.rank
    return em.const(f"_cp_scan_mine_{rank}_{table.shape[1]}", table[rank].clone())


def _cummaxmin(em: Emitter, name: str, scanned: fx.Node, runs: Tuple[torch.Tensor, Any], nd: int, d: int,
               dtype: torch.dtype):
    """cummax/cummin of the runs (``nd`` dims, run j along ``d``, its tokens along ``d + 1``): values and
    *global* indices, (..., k, L, ...) each (see the module doc)."""
    table, length = runs
    rank = em.ctx.group.rank
    local_v = em.call(operator.getitem, scanned, 0)  # (..., k, L, ...)
    view = [1] * d + [-1, 1] + [1] * (nd - d - 2)
    start = em.method("view", em.const(f"_cp_scan_start_{rank}_{table.shape[1]}", table[rank].clone()), *view)
    start = em.call(operator.mul, start, length)  # the first global position of each run
    local_i = em.call(operator.add, em.call(operator.getitem, scanned, 1), start)  # (..., k, L, ...) global
    values, positions = _totals(em, local_v, d, dtype, em.call(torch.select, local_i, d + 1, -1))
    incl = em.call(_SCANS[name], values, d)  # over the chunks: (best value, chunk of the winner)
    incl_v = em.call(operator.getitem, incl, 0)
    incl_i = em.call(torch.take_along_dim, positions, em.call(operator.getitem, incl, 1), d)
    chunks, mine = table.numel(), _mine(em, table)
    prefix_v = _shift(em, incl_v, d, chunks, _identity(name, dtype))
    prefix_v = em.method("unsqueeze", em.method("index_select", prefix_v, d, mine), d + 1)
    prefix_i = em.method("unsqueeze", em.method("index_select", _shift(em, incl_i, d, chunks, 0), d, mine), d + 1)
    wins = em.call(operator.ge if name == "cummax" else operator.le, local_v, prefix_v)  # ties: the later index
    wins = em.call(operator.or_, wins, em.call(torch.isnan, local_v))  # a NaN wins from where it occurs
    return em.call(torch.where, wins, local_v, prefix_v), em.call(torch.where, wins, local_i, prefix_i)
