"""Layout rules for data-dependent selections of tokens: mixture-of-experts routing.

A token-choice MoE flattens the tokens to rows, routes each row by its own router scores,
selects or groups the rows of each expert by data, runs the experts on them and puts the
results back by row index. Routing is per token, so under CP each rank routes its own
tokens. The rules, on rows of this rank (c = S/N tokens, T = B·S flattened, k slots):

    mask (E, k, T/N) Sharded(2) ─ torch.where / nonzero ─> idx, top_x (n_local,) Local(0)   top_x: token=(T, 1)
    ids (T/N·k,) Sharded(0, inner k) ─ sort ─> ids_g, perm (T/N·k,) Local(0, whole)          perm: token=(T·k, k)
    perm // k ─> token=(T, 1)
    h (T/N, D) Sharded(0)   h[top_x] / h[None, top_x] / index_select(h, 0, top_x) ─> Local rows
    w (T/N, k) Sharded(0)   w[top_x, idx, None] ─> Local rows
    Local rows ─ linear / silu / * / chunk / views keeping the rows / casts ─> Local   (routing_rows.py)
    histc(ids_g) -> cumsum -> offsets: Local summary; grouped_mm(rows, W, offs=offsets) ─> Local rows
    out (T/N, D) Sharded(0) .index_add_(0, top_x, rows) ─> Sharded(0)
        also out[top_x] += rows, out.index_put_((top_x,), rows, accumulate), out.scatter_add_(0,
        top_x[:, None].expand(-1, D), rows); an out built whole is written in its rows here
    inv = empty_like(perm); inv[perm] = arange(n) ─> inv Sharded(0, inner k), row numbers of the sort
    rows[inv] ─> Sharded(0, inner k): each token's row back in token order
    (W[ids] with ids Sharded, a row of W per token as in HF's batched_mm experts: getitem's table lookup)

``Local(d)``: the rows along d are the rows the one-process program selects, restricted to
this rank's tokens, in this rank's order (``rows`` names the selection). Indices found on
dim d of a ``Sharded(d, inner)`` tensor are indices into this rank's rows of any tensor whose
token dim has the same global size and ``inner`` (the same local arrangement
``outer·(c·inner) + token·inner + rest``), so they select and scatter among this rank's rows
with no communication. What has no per-rank form (a reduction or scan over the selected rows
into a value used outside the selection, mixing two selections, an index into a dim laid out
differently) is refused with a CPRewriteError naming the op, its line and the fix: a Local
value cannot be gathered, its rows have no global positions. Dynamo keeps ``nonzero`` in the
graph under ``fullgraph=True`` (or ``capture_dynamic_output_shape_ops = True``); otherwise the
graph breaks there and the selection runs between graphs on whole values.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx

from ...context import fake_value, global_shape
from ...op_vocab import INDEX_ADDS, INDEX_PUTS, SCATTERS, SELECTIONS, SORTS, arguments, rule_keys
from ..emitter import Emitter, mutates
from ..placements import GLOBAL, Local, Sharded
from .common import _flat_args, _key, _sharded
from .pointwise import pointwise
from .registry import chunk_aware, register_rule
from .routing_rows import refuse, rowwise, rows_rule

_SELECT, _INDEX_ADD, _INDEX_PUT, _SCATTER = (rule_keys(s) for s in (SELECTIONS, INDEX_ADDS, INDEX_PUTS, SCATTERS))


def is_selection(node: fx.Node) -> bool:
    """``torch.where(x)`` with one argument, ``nonzero``, ``argwhere``: indices found by data."""
    if _key(node) in _SELECT:
        return True
    return node.target is torch.where and len(node.args) == 1 and not node.kwargs


@register_rule(*SELECTIONS)
def select(em: Emitter, node: fx.Node):
    """Indices of the nonzeros of a Sharded ``x``: Local rows; those on the token dim index this rank's rows."""
    x = node.args[0]
    s, shape = _sharded(em, x), global_shape(x)
    token = (shape[s.dim], s.inner)
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    if node.target is torch.where or node.kwargs.get("as_tuple", False):  # one (n,) tensor per dim of x
        return new, tuple(Local(0, token if d == s.dim else None, node.name) for d in range(len(shape)))
    return new, Local(0, None, node.name)  # (n, ndim): columns are not followed as token indices


@chunk_aware
@register_rule(torch.where)
def where(em: Emitter, node: fx.Node):
    """``torch.where``: the selection form with one argument (not of chunks: gathered), else the
    pointwise rule."""
    if is_selection(node) and any(s.chunk > 1 for a in node.all_input_nodes if (s := _sharded(em, a))):
        return em.fallback(node, "a selection of rows from the sequence viewed in chunks")
    return select(em, node) if is_selection(node) else pointwise(em, node)


@register_rule(*SORTS)
def sort(em: Emitter, node: fx.Node):
    """``sort`` / ``argsort`` of 1-D Sharded values (expert ids): this rank's rows permuted, and the
    permutation as token indices. A sort of a tensor with other dims is order.py's (:func:`.order.sort_whole`)."""
    x, s = node.args[0], _sharded(em, node.args[0])
    dim = arguments(node, ("input", "dim")).get("dim", -1)
    if len(global_shape(x)) != 1 or dim not in (0, -1):
        from .order import sort_whole

        return sort_whole(em, node)
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    perm = Local(0, (global_shape(x)[0], s.inner), node.name, whole=True)
    if "argsort" in str(_key(node)):
        return new, perm
    return new, (Local(0, None, node.name, whole=True), perm)


def involves_local(em: Emitter, node: fx.Node) -> bool:
    return any(isinstance(a, fx.Node) and (isinstance(em.layout(a), Local) or a in em.row_numbers)
               for a in _flat_args(node))


def local_rule(em: Emitter, node: fx.Node):
    """Layout and new value of ``node``, which reads a Local value (see the module docstring)."""
    key = _key(node)
    if key is operator.getitem or key in (torch.index_select, ("method", "index_select")):
        return _index(em, node)
    if key in _INDEX_ADD:
        return _index_add(em, node)
    if key in _INDEX_PUT:
        return _index_put(em, node)
    if key in _SCATTER:
        return _scatter(em, node)
    if key is operator.setitem:
        return _invert(em, node) if isinstance(em.layout(node.args[0]), Local) else _set_rows(em, node)
    return rows_rule(em, node)


# ------------------------------------------------------------------------- indexing
def _index(em: Emitter, node: fx.Node):
    """``x[..., top_x, idx, None]`` / ``index_select(x, d, top_x)`` with Local index tensors."""
    x = node.args[0]
    if _key(node) is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    else:
        a = arguments(node, ("input", "dim", "index"))
        d, idx = a["dim"], a["index"]
        index = (slice(None),) * (d % len(global_shape(x))) + (idx,)
    if any(i in em.row_numbers for i in index if isinstance(i, fx.Node)):
        return _back_to_tokens(em, node, x, index)
    if isinstance(em.layout(x), Local) and not any(isinstance(i, fx.Node) for i in index):
        return rowwise(em, node)  # basic indexing of selected rows
    if any(i is Ellipsis for i in index):
        return refuse(em, node, "indexes with `...` and a selection")
    x_new, why = _source_rows(em, x, index)
    if why:
        return refuse(em, node, why)
    lays = {em.layout(i) for i in index if isinstance(i, fx.Node)}
    rows = {lay.rows for lay in lays}
    at = next(p for p, i in enumerate(index) if isinstance(i, fx.Node))
    if len(rows) != 1 or any(lay.dim != 0 for lay in lays):
        return refuse(em, node, "indexes with tensors that are not one selection of rows")
    lay = next(iter(lays))
    out_dim = sum(1 for i in index[:at] if not isinstance(i, int))  # where the advanced dims land (adjacent)
    return em.copy(node, (x_new, *em.value(node.args[1:])), em.value(node.kwargs)), \
        Local(out_dim, None, lay.rows, lay.whole)


def _source_rows(em: Emitter, x: fx.Node, index: Tuple[Any, ...]) -> Tuple[Any, str]:
    """x's new value to index with ``index`` (a whole x is first indexed by this rank's positions)."""
    dim = 0
    for i in index:
        if i is None:
            continue
        lay = em.layout(i) if isinstance(i, fx.Node) else None
        if isinstance(i, fx.Node) and not isinstance(lay, Local):
            return None, "indexes with a tensor that is not a selection of this rank's rows"
        if isinstance(lay, Local) and lay.token is not None:
            return _token_source(em, x, dim, lay.token)
        dim += 1
    if isinstance(em.layout(x), Sharded):
        return None, "indexes the sequence-sharded tokens with indices that are not token indices"
    return em.env[x], ""


def _token_source(em: Emitter, x: fx.Node, dim: int, token: Tuple[int, int]) -> Tuple[Any, str]:
    """x indexed along ``dim`` by token indices of ``token = (global size, inner)``."""
    lay, size = em.layout(x), global_shape(x)[dim]
    if isinstance(lay, Sharded) and lay.dim == dim and (size, lay.inner) == token:
        return em.env[x], ""
    if lay in (None, GLOBAL) and size == token[0]:  # one entry per token, held whole: this rank's rows first
        return em.to_sharded(x, dim, token[1]), ""
    return None, (f"indexes dim {dim} of a {tuple(global_shape(x))} tensor ({lay}) with indices into this "
                  f"rank's rows of a token dim of {token[0]} rows (inner {token[1]}), laid out differently")


def _index_add(em: Emitter, node: fx.Node):
    """``out.index_add_(d, top_x, rows)``: rows added back into this rank's rows of a Sharded ``out``."""
    a = arguments(node, ("input", "dim", "index", "source"))
    dim, idx, src = a["dim"], a["index"], a["source"]
    return _write_back(em, node, dim % len(global_shape(node.args[0])), idx, src, 0)


def _index_put(em: Emitter, node: fx.Node):
    """``out.index_put_((top_x,), rows, accumulate)``: index_add_ / index_copy_ along dim 0."""
    a = arguments(node, ("input", "indices", "values"))
    indices, values = a["indices"], a["values"]
    if not (isinstance(indices, (tuple, list)) and len(indices) == 1):
        return refuse(em, node, "writes by more than one index tensor")
    return _write_back(em, node, 0, indices[0], values, 0)


def _set_rows(em: Emitter, node: fx.Node):
    """``out[top_x] = rows`` (also ``out[top_x] += rows``: a getitem, an add, this setitem)."""
    _, index, values = node.args
    index = index if isinstance(index, tuple) else (index,)
    if len(index) != 1 or not isinstance(index[0], fx.Node):
        return refuse(em, node, "writes by an index other than one tensor of token indices")
    return _write_back(em, node, 0, index[0], values, 0)


def _scatter(em: Emitter, node: fx.Node):
    """``out.scatter_add_(0, top_x[:, None].expand(-1, D), rows)`` (and scatter_, scatter_reduce_):
    each index value a token index of this rank, on the same rows as ``src``."""
    a = arguments(node, ("input", "dim", "index", "src"))
    dim, idx, src = a["dim"], a["index"], a["src"]
    dim = dim % len(global_shape(node.args[0]))
    return _write_back(em, node, dim, idx, src, dim)


def _write_back(em: Emitter, node: fx.Node, dim: int, idx: Any, src: Any, idx_dim: int):
    """A write of selected rows ``src`` into ``out`` (node.args[0]) at the token indices ``idx`` along
    ``dim``: this rank's rows of a Sharded ``out``, no communication. ``idx_dim``: where idx's rows are."""
    out, ilay, slay = node.args[0], em.layout(idx), em.layout(src)
    if not (isinstance(ilay, Local) and ilay.token is not None and isinstance(slay, Local)):
        return refuse(em, node, "writes rows by indices that are not token indices of a selection")
    if ilay.rows != slay.rows or ilay.dim != idx_dim or slay.dim != dim:
        return refuse(em, node, "writes rows of another selection than its indices")
    out_new, why = _token_source(em, out, dim, ilay.token)
    if why:
        return refuse(em, node, why)
    new = em.copy(node, (out_new, *em.value(node.args[1:])), em.value(node.kwargs))
    lay = Sharded(dim, ilay.token[1])
    if mutates(node) and not isinstance(em.layout(out), Sharded):  # a whole out: the write went to its rows here
        em.env[out], em.layouts[out] = out_new, lay  # later readers of out read the written rows
    return new, (None if node.target is operator.setitem else lay)


# ------------------------------------------------------------------------- the inverse permutation
def _invert(em: Emitter, node: fx.Node):
    """``inv[perm] = arange(n)`` with perm a sort's token indices and inv made like perm: inv becomes
    token-indexed, Sharded(0, inner), holding each token's row number in the sort (this rank's)."""
    inv, perm, values = node.args
    plan, ilay = em.layout(perm), em.layout(inv)
    if not (isinstance(plan, Local) and plan.whole and plan.token and isinstance(ilay, Local)
            and ilay.rows == plan.rows and _is_arange(values, global_shape(perm)[0])):
        return refuse(em, node, "writes by a selection's indices (only `inv[perm] = arange(n)`, the inverse "
                                "of a sort, has a per-rank form)")
    ex = fake_value(values)
    rows = em.call(torch.arange, em.method("size", em.env[perm], 0), dtype=ex.dtype, device=ex.device)
    new = em.copy(node, (em.env[inv], em.env[perm], rows), {})
    em.layouts[inv] = Sharded(0, plan.token[1])  # every token's entry written: token-indexed from here on
    em.row_numbers[inv] = plan.rows
    return new, None


def _is_arange(node: Any, n: int) -> bool:
    """``torch.arange(n)`` (the row numbers 0..n-1 of a selection of n rows)."""
    return isinstance(node, fx.Node) and node.target is torch.arange and tuple(node.args) in ((n,), (0, n))


def _back_to_tokens(em: Emitter, node: fx.Node, x: fx.Node, index: Tuple[Any, ...]):
    """``rows[inv]``: each token's row of the sort, in token order -> Sharded like inv."""
    inv = next(i for i in index if isinstance(i, fx.Node))
    lay, ilay = em.layout(x), em.layout(inv)
    if len(index) != 1 or not isinstance(lay, Local) or lay.dim != 0 or lay.rows != em.row_numbers[inv]:
        return refuse(em, node, "indexes with row numbers of a selection something other than its rows")
    return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(ilay.dim, ilay.inner)


def token_of(lay: Optional[Local]) -> Optional[Tuple[int, int]]:
    return lay.token if isinstance(lay, Local) else None
