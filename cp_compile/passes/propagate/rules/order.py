"""Layout rules for reductions over the sequence that return positions or follow the order of the
values (docs/design.md §6): argmax/argmin, max/min/median/kthvalue with a dim, topk, and sort/argsort
of per-token scalars (with routing.py, which keeps the 1-D sort of expert ids).

    x (B, S/N) Sharded(1)  x.argmax(1)       -> (B,) Global  int64 global positions
    x (B, S/N, D)          x.max(1)           -> (values (B, D), indices (B, D)) Global
    x (B, S/N, D)          torch.topk(x, k, 1) -> (B, k, D) values and indices, Global
    x (B, S/N)             x.kthvalue(k, 1) / x.median(1) -> (B,) Global pairs
    x (B, S/N)             x.sort(1) / x.argsort(1) -> (B, S) Global
    x (B, S/N, D)          x.argmax(2)        -> (B, S/N) Sharded(1)       (not over the sequence: per token)

Over the sequence, each rank reduces its own tokens first, its padding rows set to the value
that never wins (-inf / +inf, the dtype's min / max for integers), its local indices turned into
global positions (``positions(rank)[i]``); one ``gather_stack`` brings every rank's candidates
(value, global position) to every rank ((N, ...), for ``topk`` / ``kthvalue`` the best min(k, c)
of each rank), and the same selection over the N candidates finishes on every rank:

    cand_v, cand_i = gather_stack(local values), gather_stack(positions(rank)[local indices])
    argmax: w = where(cand_v == cand_v.max(), cand_i, BIG).argmin()  -> cand_i[w], cand_v[w]

Ties are broken as torch breaks them: argmax/argmin/max/min return the first occurrence (the
smallest position) among equal values: a rank's tokens are in increasing global order, so the
local first is the rank's smallest, and across ranks the smallest position among tied candidates
wins. ``topk``, ``kthvalue`` and ``median`` leave the order of ties unspecified in torch, and so
here. NaNs are not followed (torch would return the NaN's position). The values come out of the
gathered candidates, so their gradient goes back through the gather's reduce-scatter to the
owner's local reduction, whose backward puts it on the winning row.

``sort`` / ``argsort`` along the sequence return S values: for per-token scalars (the sequence
is the last dim, e.g. (B, S)) the shards are stacked by one ``gather_stack`` and put in global
order, and the sort runs whole on every rank (its result is Global, as small as its input). A
sort over a sequence followed by feature dims, the sequence merged with other dims (``inner``,
flattened tokens), or a symbolic / per-batch layout is gathered (the fallback, warned).
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx

from ... import op_vocab
from ...context import fake_value, global_shape
from ...op_vocab import arguments
from ..emitter import Emitter
from ..oracle import decide
from ..placements import GLOBAL, Sharded
from .common import _name, _sharded
from .registry import chunk_aware, register_rule

ARGEXT = (torch.argmax, torch.argmin, "argmax", "argmin")
EXTREMA = (torch.max, torch.min, "max", "min")
KTH = (torch.kthvalue, "kthvalue", torch.median, "median")


def _unruled(em: Emitter, node: fx.Node, why: str):
    """A form the rules here do not cover: the oracle's verdict, else the fallback (as without a rule)."""
    decided = decide(em, node)
    return decided if decided is not None else em.fallback(node, why)


def _seq_dim(em: Emitter, node: fx.Node, dim: Any) -> Tuple[Optional[Sharded], Optional[int], str]:
    """(layout of x, dim normalised, why not) for a reduction of x = node.args[0] along ``dim``."""
    x = node.args[0]
    s, shape = _sharded(em, x), global_shape(x)
    if s is None or not isinstance(dim, int):
        return None, None, "with no dim or a dim read from the data"
    d = dim % len(shape)
    if d != s.dim:
        return s, d, ""
    if s.chunk > 1:
        return s, d, "over the sequence viewed in chunks"
    if s.inner != 1 or shape[d] != em.ctx.seq_len:
        return s, d, "over a dim that merges the sequence with other dims (flattened tokens)"
    if em.index.runtime:
        return s, d, "under a symbolic sequence length or a per-batch layout"
    if fake_value(x).dtype is torch.bool:
        return s, d, "of a boolean tensor"
    return s, d, ""


def _per_token(em: Emitter, node: fx.Node, s: Sharded, d: int, keeps_dim: bool):
    """The op along a dim other than the sequence: run on this rank's tokens (or chunks), Sharded."""
    shift = 0 if keeps_dim or d > s.dim else 1
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    lay = Sharded(s.dim - shift, s.inner, chunk=s.chunk)
    return new, (lay if _name(node) in ("argmax", "argmin") else (lay, lay))


def _masked(em: Emitter, x: fx.Node, s: Sharded, largest: bool) -> fx.Node:
    """x's local value with the padding rows set to what never wins (-inf for a max, +inf for a min)."""
    mask = em.valid_mask(x, em.env[x], s.dim, s.inner)
    if mask is None:
        return em.env[x]
    dtype = fake_value(x).dtype
    if dtype.is_floating_point:
        fill = -float("inf") if largest else float("inf")
    else:
        fill = torch.iinfo(dtype).min if largest else torch.iinfo(dtype).max
    return em.call(torch.where, mask, em.env[x], fill)


def _candidates(em: Emitter, x: fx.Node, s: Sharded, k: int, largest: bool) -> Tuple[fx.Node, fx.Node]:
    """Every rank's best ``k`` (k = 0: the first extremum) of its own tokens along s.dim, as
    (values, global positions), stacked along s.dim in rank order: (..., N·max(k, 1), ...), Global."""
    from .... import graph_ops

    d, xm = s.dim, _masked(em, x, s, largest)
    if k == 0:  # max / min return the first occurrence (topk would not say which)
        pair = em.call(torch.max if largest else torch.min, xm, d, True)
    else:
        pair = em.call(torch.topk, xm, min(k, em.ctx.padded_len // em.ctx.world), d, largest, True)
    vals, idx = em.call(operator.getitem, pair, 0), em.call(operator.getitem, pair, 1)
    glob = em.call(operator.getitem, em.index.positions(em.ctx.group.rank), idx)  # local rows -> global positions
    out = []
    for t in (vals, glob):
        stacked = em.call(graph_ops.gather_stack, t, em.ctx.world, em.ctx.group.name)  # (N, ..., k, ...)
        out.append(em.method("flatten", em.method("movedim", stacked, 0, d), d, d + 1))
    return out[0], out[1]


def _first_extremum(em: Emitter, x: fx.Node, s: Sharded, largest: bool, keep: bool) -> Tuple[fx.Node, fx.Node]:
    """(value, global position) of the first max (min) along the sequence, keepdim as ``keep``. Global."""
    d = s.dim
    cand_v, cand_i = _candidates(em, x, s, 0, largest)  # (..., N, ...)
    best = em.method("amax" if largest else "amin", cand_v, d, True)
    big = em.call(torch.full_like, cand_i, em.ctx.padded_len)
    key = em.call(torch.where, em.call(torch.eq, cand_v, best), cand_i, big)  # tied candidates by position
    win = em.method("argmin", key, d, True)  # the rank holding the smallest tied position
    val, idx = em.method("gather", cand_v, d, win), em.method("gather", cand_i, d, win)
    if not keep:
        val, idx = em.method("squeeze", val, d), em.method("squeeze", idx, d)
    return val, idx


@chunk_aware
@register_rule(*ARGEXT)
def argext(em: Emitter, node: fx.Node):
    """``argmax`` / ``argmin`` along the sequence: the first extremum's global position, Global (int64)."""
    a = arguments(node, ("input", "dim", "keepdim"))
    s, other = _along_sequence(em, node, a)
    if s is None:
        return other
    _, idx = _first_extremum(em, node.args[0], s, _name(node) == "argmax", a.get("keepdim", False))
    return idx, GLOBAL


def _along_sequence(em: Emitter, node: fx.Node, a: dict) -> Tuple[Optional[Sharded], Any]:
    """(the Sharded layout of the input, None) when ``node`` reduces along its sequence dim; else (None,
    the node's result): per token along another dim, or gathered with the reason."""
    s, d, why = _seq_dim(em, node, a.get("dim"))
    if s is not None and d != s.dim and not why:
        return None, _per_token(em, node, s, d, a.get("keepdim", False))
    if s is None or why:
        return None, _unruled(em, node, f"{_name(node)} {why}")
    return s, None


@chunk_aware  # (along another dim than the chunks': per chunk; along them: gathered)
@register_rule(*EXTREMA)
def extremum(em: Emitter, node: fx.Node):
    """``max`` / ``min`` with a dim along the sequence: (values, global positions), Global. The
    elementwise form ``torch.max(a, b)`` and the whole reduction ``x.max()`` are not these rules'."""
    second = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    if isinstance(fake_value(second) if isinstance(second, fx.Node) else None, torch.Tensor):
        from .pointwise import pointwise

        return pointwise(em, node)  # torch.max(a, b): elementwise
    a = arguments(node, ("input", "dim", "keepdim"))
    s, other = _along_sequence(em, node, a)
    if s is None:
        return other
    val, idx = _first_extremum(em, node.args[0], s, _name(node) == "max", a.get("keepdim", False))
    return (val, idx), (GLOBAL, GLOBAL)


@chunk_aware
@register_rule(torch.topk, "topk")
def topk(em: Emitter, node: fx.Node):
    """``topk`` along the sequence: every rank's best min(k, c), stacked, then topk of those: Global."""
    a = arguments(node, ("input", "k", "dim", "largest", "sorted"))
    s, d, why = _seq_dim(em, node, a.get("dim", -1))
    if s is not None and d != s.dim and not why:
        return _per_token(em, node, s, d, True)
    if s is None or why or not isinstance(a["k"], int):
        return _unruled(em, node, f"topk {why or 'with k read from the data'}")
    largest = a.get("largest", True)
    cand_v, cand_i = _candidates(em, node.args[0], s, a["k"], largest)
    pair = em.call(torch.topk, cand_v, a["k"], d, largest, True)  # sorted: torch's unsorted order is unspecified
    sel = em.call(operator.getitem, pair, 1)
    return (em.method("gather", cand_v, d, sel), em.method("gather", cand_i, d, sel)), (GLOBAL, GLOBAL)


@chunk_aware
@register_rule(*KTH)
def kth(em: Emitter, node: fx.Node):
    """``kthvalue(k, dim)`` / ``median(dim)`` (the lower median: k = (S + 1) // 2) along the sequence:
    every rank's smallest min(k, c), stacked, then the kthvalue of those: Global."""
    median = _name(node) == "median"
    a = arguments(node, ("input", "dim", "keepdim") if median else ("input", "k", "dim", "keepdim"))
    s, d, why = _seq_dim(em, node, a.get("dim", -1) if not median else a.get("dim"))
    if s is not None and d != s.dim and not why:
        return _per_token(em, node, s, d, a.get("keepdim", False))
    k = (em.ctx.seq_len + 1) // 2 if median else a.get("k")
    if s is None or why or not isinstance(k, int):
        return _unruled(em, node, f"{_name(node)} {why or 'with k read from the data'}")
    cand_v, cand_i = _candidates(em, node.args[0], s, k, False)
    sel = em.call(operator.getitem, em.call(torch.kthvalue, cand_v, k, d, True), 1)
    val, idx = em.method("gather", cand_v, d, sel), em.method("gather", cand_i, d, sel)
    if not a.get("keepdim", False):
        val, idx = em.method("squeeze", val, d), em.method("squeeze", idx, d)
    return (val, idx), (GLOBAL, GLOBAL)


def sort_whole(em: Emitter, node: fx.Node):
    """``sort`` / ``argsort`` along the sequence of per-token scalars (the sequence the last dim):
    the shards stacked (``gather_stack``), put in global order, sorted whole on every rank: Global.
    Along another dim: per token, Sharded. Anything else is gathered."""
    x = node.args[0]
    a = arguments(node, ("input", "dim"))
    s, d, why = _seq_dim(em, node, a.get("dim", -1))
    if s is not None and d != s.dim and not why:
        new = em.copy(node, *em.value((node.args, node.kwargs)))
        return new, (Sharded(s.dim, s.inner) if op_vocab.is_(node, {torch.argsort, "argsort"})
                     else (Sharded(s.dim, s.inner),) * 2)
    if s is None or why or d != len(global_shape(x)) - 1:
        return _unruled(em, node, f"{_name(node)} along the sequence {why or 'of a tensor with feature dims'}")
    whole = stacked_whole(em, em.env[x], d)
    args, kwargs = em.value((node.args, node.kwargs))
    return em.copy(node, (whole, *args[1:]), kwargs), \
        (GLOBAL if op_vocab.is_(node, {torch.argsort, "argsort"}) else (GLOBAL, GLOBAL))


def stacked_whole(em: Emitter, local: fx.Node, d: int) -> fx.Node:
    """A small Sharded(d) value (per-token scalars, a mask) whole on every rank: every rank's shard stacked
    by one ``gather_stack`` (backward: reduce-scatter), put in global order, the padding dropped."""
    from .... import graph_ops

    stacked = em.call(graph_ops.gather_stack, local, em.ctx.world, em.ctx.group.name)  # (N, ..., c, ...)
    rank_major = em.method("flatten", em.method("movedim", stacked, 0, d), d, d + 1)  # (..., N·c, ...)
    return em.method("index_select", rank_major, d, em.index.order_inverse()[1])  # (..., S, ...) global order
