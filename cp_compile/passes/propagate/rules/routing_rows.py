"""Per-row ops on rows selected from this rank's tokens (the Local layout of :mod:`.routing`).

    rows (n, D) Local ─ linear / silu / * / to / chunk(-1) / reshape(-1, D) ─> Local (same selection)
    rows[:, None] ─> Local;   perm // k ─> token indices of a dim with inner / k
    sym_size(rows, 0), _assert_scalar(u0 <= 480) ─> this rank's sizes (the bounds still hold)
    histc(ids_g) ─> Local summary (counts of this rank's rows);  cumsum(counts) ─> Local summary
    grouped_mm(rows, W (E, K, N), offs=summary) ─> Local rows (row r times W[its group])

Two Local operands must be the same selection (``Local.rows``); a Global operand must not run
along the rows (weights, scalars, size-1 dims). A view keeps the rows when the dims before
them multiply to the same size before and after. Anything else is refused (:func:`refuse`).
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional

import torch
import torch.fx as fx

from ...context import CPRewriteError, fake_value, source_line
from ...op_vocab import LINEAR, NORMS, POINTWISE, SHAPE_VIEWS, SOFTMAXES, arguments, rule_keys
from ..emitter import Emitter
from ..placements import GLOBAL, Local, Sharded
from .common import _flat_args, _key, _name

_ROWWISE = rule_keys(POINTWISE | LINEAR | NORMS | SOFTMAXES | {
    torch.matmul, operator.matmul, torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
    "type", "long", "int", "bool", "chunk", "split", torch.chunk, torch.split, "unbind", torch.unbind,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, "add_", "sub_", "mul_", "div_"})
_VIEWS = rule_keys(SHAPE_VIEWS)
_KEEP_TOKEN = _VIEWS | rule_keys({"to", "clone", "detach", "long", "int", "type"}) | {
    operator.getitem}  # basic indexing (the tensor-index forms are routing._index) keeps a subset of the values
_SIZES = {torch.ops.aten.sym_size.int, ("method", "size"), torch.ops.aten._assert_scalar.default}
_SUMMARY_OPS = rule_keys({torch.cumsum, "cumsum"} | POINTWISE)
_GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")  # torch._grouped_mm, F.grouped_mm, HF's fallback op


def rows_rule(em: Emitter, node: fx.Node):
    """A node reading Local values that is not an index op (those are in :mod:`.routing`)."""
    key = _key(node)
    if key in _SIZES:
        return em.copy(node, *em.value((node.args, node.kwargs))), GLOBAL  # this rank's sizes: asserts hold
    if key in (torch.histc, ("method", "histc")):
        return _summary(em, node, "counts the selected rows")
    if _name(node).split(".")[0] in _GROUPED_MM:
        return _grouped_mm(em, node)
    locals_ = [a for a in _flat_args(node) if isinstance(em.layout(a), Local)]
    if locals_ and all(em.layout(a).dim is None for a in locals_):
        if key in _SUMMARY_OPS:
            return _summary(em, node, "combines a per-rank summary of the selected rows")
        return refuse(em, node, "uses a per-rank summary of the selected rows (e.g. counts per expert) "
                                "outside the selection")
    if (key in _ROWWISE or key in _VIEWS or key is operator.getitem) and not _across_rows(em, node):
        return rowwise(em, node)
    return refuse(em, node, "is not known to act on each selected row alone")


def _across_rows(em: Emitter, node: fx.Node) -> bool:
    """A per-token op used across the rows: softmax over them, a matmul contracting them or with
    the rows on the right, a layer norm over them."""
    key, x = _key(node), node.args[0] if node.args else None
    lay = em.layout(x) if isinstance(x, fx.Node) else None
    nd = fake_value(x).dim() if isinstance(fake_value(x), torch.Tensor) else 0
    if key in rule_keys(SOFTMAXES):
        dim = arguments(node, ("input", "dim")).get("dim")
        return not isinstance(lay, Local) or dim is None or dim % nd == lay.dim
    if key in (torch.matmul, operator.matmul):
        return not isinstance(lay, Local) or lay.dim >= nd - 1 or isinstance(em.layout(node.args[1]), Local)
    if key in NORMS:  # layer_norm, rms_norm: over the trailing normalized_shape
        shape = arguments(node, ("input", "normalized_shape"))["normalized_shape"]
        shape = shape if isinstance(shape, (list, tuple)) else (shape,)
        return not isinstance(lay, Local) or lay.dim >= nd - len(shape)
    return False


def rowwise(em: Emitter, node: fx.Node):
    """Every Local operand the same selection, the rest Global and not along the rows: copy, Local."""
    locals_ = [a for a in _flat_args(node) if isinstance(em.layout(a), Local)]
    if any(isinstance(em.layout(a), Sharded) for a in _flat_args(node)):
        return refuse(em, node, "combines selected rows with the sequence-sharded tokens directly")
    lays = [em.layout(a) for a in locals_]
    if len({lay.rows for lay in lays}) != 1 or any(lay.dim is None for lay in lays):
        return refuse(em, node, "combines two different selections of rows")
    src, lay = locals_[0], lays[0]
    outs = _outputs(node)
    dims = [_row_dim(em, node, src, lay.dim, out) for out in outs]
    if not outs or None in dims:
        return refuse(em, node, "does not keep the selected rows as one dim")
    token = _token(node, lay) if len(locals_) == 1 else None
    new_lays = [Local(d, token, lay.rows, lay.whole) for d in dims]
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    return new, (tuple(new_lays) if isinstance(fake_value(node), (tuple, list)) else new_lays[0])


def _outputs(node: fx.Node) -> List[torch.Tensor]:
    val = fake_value(node)
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return vals if all(isinstance(v, torch.Tensor) for v in vals) else []


def _row_dim(em: Emitter, node: fx.Node, src: fx.Node, dim: int, out: torch.Tensor) -> Optional[int]:
    """Where the rows of ``src`` (dim ``dim``) land in ``out``: right-aligned for pointwise ops, by the
    product of the dims before them for views; None if their size is not there."""
    x = fake_value(src)
    n = x.shape[dim]
    if _key(node) in _VIEWS or _key(node) is operator.getitem:
        before = _prod(x.shape[:dim])
        cands = [d for d in range(out.dim()) if _same(out.shape[d], n) and _same(_prod(out.shape[:d]), before)]
        return cands[0] if len(cands) == 1 else None
    d = dim + out.dim() - x.dim()
    return d if 0 <= d < out.dim() and _same(out.shape[d], n) else None


def _token(node: fx.Node, lay: Local) -> Optional[tuple]:
    """Token indices survive views and casts, and ``// m`` when m divides their inner."""
    if lay.token is None:
        return None
    if _key(node) in _KEEP_TOKEN:
        return lay.token
    if node.target not in (operator.floordiv, torch.floor_divide):
        return None
    _, m = list(arguments(node, ("input", "other")).values())[:2]  # (a, b) of operator.floordiv
    if type(m) is int and m > 0 and lay.token[1] % m == 0:
        return (lay.token[0] // m, lay.token[1] // m)
    return None


def _summary(em: Emitter, node: fx.Node, what: str):
    """A value of this rank's selected rows taken together (histc counts, their cumsum): per rank."""
    lays = [em.layout(a) for a in _flat_args(node) if isinstance(em.layout(a), Local)]
    if len({lay.rows for lay in lays}) != 1 or any(isinstance(em.layout(a), Sharded) for a in _flat_args(node)):
        return refuse(em, node, what + " of two selections")
    return em.copy(node, *em.value((node.args, node.kwargs))), Local(None, None, lays[0].rows, lays[0].whole)


def _grouped_mm(em: Emitter, node: fx.Node):
    """``grouped_mm(rows, W, offs=counts)``: rows grouped by the offsets, group g times W[g]: per row,
    with the offsets of this rank's rows (the summary of the same selection)."""
    rows, w = node.args[0], node.args[1]
    offs = arguments(node, ("mat_a", "mat_b", "offs")).get("offs")
    lr, lo = em.layout(rows), em.layout(offs)
    if not (isinstance(lr, Local) and lr.dim == 0 and isinstance(lo, Local) and lo.dim is None
            and lo.rows == lr.rows and em.layout(w) in (None, GLOBAL)):
        return refuse(em, node, "groups rows by offsets that are not the counts of the same selection")
    return em.copy(node, *em.value((node.args, node.kwargs))), Local(0, None, lr.rows, lr.whole)


def _same(a: Any, b: Any) -> bool:
    """Size equality without guarding on unbacked sizes (compares the expressions)."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else a
    eb = b.node.expr if isinstance(b, torch.SymInt) else b
    if isinstance(ea, int) and isinstance(eb, int):
        return ea == eb
    try:
        return bool(ea == eb) if not (isinstance(ea, int) or isinstance(eb, int)) else False
    except TypeError:
        return False


def _prod(sizes: Any) -> Any:
    out = 1
    for s in sizes:
        out = out * s
    return out


def refuse(em: Emitter, node: fx.Node, why: str):
    raise CPRewriteError(
        f"cp_compile: {_name(node)} at {source_line(node)} {why}: it reads rows selected by data from this "
        "rank's tokens (torch.where / nonzero / sort), which have no global positions to gather. Fix: act on "
        "the selected rows one by one (per-row ops, index_add_ back by the same indices), or compile with "
        "fullgraph=False (capture_dynamic_output_shape_ops off) so the selection runs between graphs, on "
        "whole values."
    )
