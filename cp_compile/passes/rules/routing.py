"""Layout rules for data-dependent selections of tokens: mixture-of-experts routing.

A token-choice MoE flattens the tokens to rows, routes each row by its own router scores,
selects the rows of each expert by data (``torch.where(mask)`` / ``nonzero``), runs the
expert on them and adds the results back by row index (``index_add_``). Routing is per
token, so under CP each rank can route its own tokens. The rule is:

    mask (E, k, B·S/N) Sharded(2) ─ torch.where ─> idx, top_x (n_local,) Local(0)     top_x: token=(B·S, 1)
    h (B·S/N, D) Sharded(0)  h[top_x] / h[None, top_x] / index_select(h, 0, top_x) ─> (n_local, D) Local
    Local rows ─ linear / silu / * / views keeping the rows / casts ─> Local
    w (B·S/N, k) Sharded(0)  w[top_x, idx, None] ─> (n_local, 1) Local
    out (B·S/N, D) Sharded(0) .index_add_(0, top_x, rows Local) ─> Sharded(0)

``Local(d)``: the rows along d are the rows the one-process program selects, restricted to
this rank's tokens, in this rank's order; the selection's length is Dynamo's unbacked size
(``u0``), which names it. Indices found on dim d of a ``Sharded(d, inner)`` mask are indices
into this rank's rows of any tensor whose token dim has the same global size and ``inner``
(the same local arrangement ``outer·(c·inner) + token·inner + rest``), so they select and
scatter among this rank's rows with no communication. Per-row ops of Local values (all
operands the same selection, weights Global) stay Local. Anything else on a Local value
(a reduction or scan over the selected rows, mixing two selections, an index into a dim
of another arrangement) has no per-rank form and is refused with a CPRewriteError naming
the op, its line and the fix: a Local value cannot be gathered, its rows have no global
positions. Dynamo captures these ops in one graph only under
``torch._dynamo.config.capture_dynamic_output_shape_ops = True``; without it the graph
breaks at ``nonzero`` and the selection runs between graphs on gathered values.
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..context import CPRewriteError, fake_value, global_shape, source_line
from ..emitter import Emitter
from ..layouts import GLOBAL, Local, Sharded
from .common import _flat_args, _key, _name, _sharded
from .pointwise import POINTWISE_FUNCS, POINTWISE_METHODS, pointwise

_SELECT = {torch.nonzero, torch.argwhere, ("method", "nonzero"), ("method", "argwhere")}
_ROWWISE = POINTWISE_FUNCS | {("method", m) for m in POINTWISE_METHODS} | {
    F.linear, torch._C._nn.linear, F.layer_norm, F.softmax, F.log_softmax, torch.matmul, operator.matmul,
    ("method", "softmax"), ("method", "type"), ("method", "long"), ("method", "int"), ("method", "bool")}
_VIEWS = {("method", m) for m in ("view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous")} | {
    torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze}
_KEEP_TOKEN = _VIEWS | {("method", m) for m in ("to", "clone", "detach", "long", "int", "type")}
_INDEX_ADD = {("method", "index_add_"), ("method", "index_add"), torch.index_add,
              ("method", "index_copy_"), ("method", "index_copy"), torch.index_copy}


def is_selection(node: fx.Node) -> bool:
    """``torch.where(x)`` with one argument, ``nonzero``, ``argwhere``: indices found by data."""
    if _key(node) in _SELECT:
        return True
    return node.target is torch.where and len(node.args) == 1 and not node.kwargs


def select(em: Emitter, node: fx.Node):
    """Indices of the nonzeros of a Sharded ``x``: Local rows; those on the token dim index this rank's rows."""
    x = node.args[0]
    s, shape = _sharded(em, x), global_shape(x)
    token = (shape[s.dim], s.inner)
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    as_tuple = node.target is torch.where or node.kwargs.get("as_tuple", False)
    if as_tuple:  # one (n,) index tensor per dim of x
        return new, tuple(Local(0, token if d == s.dim else None) for d in range(len(shape)))
    return new, Local(0)  # (n, ndim): columns are not followed as token indices


def where(em: Emitter, node: fx.Node):
    """``torch.where``: the selection form with one argument, else the pointwise rule."""
    return select(em, node) if is_selection(node) else pointwise(em, node)


def involves_local(em: Emitter, node: fx.Node) -> bool:
    return any(isinstance(em.layout(a), Local) for a in _flat_args(node))


def local_rule(em: Emitter, node: fx.Node):
    """Layout and new value of ``node``, which reads a Local value (see the module docstring)."""
    key = _key(node)
    if key is operator.getitem or key in (torch.index_select, ("method", "index_select")):
        return _index(em, node)
    if key in _INDEX_ADD:
        return _index_add(em, node)
    if key in (torch.ops.aten.sym_size.int, ("method", "size"), torch.ops.aten._assert_scalar.default):
        return em.copy(node, *em.value((node.args, node.kwargs))), GLOBAL  # this rank's sizes: asserts hold
    if key in _ROWWISE or key in _VIEWS:
        return _rowwise(em, node)
    return _refuse(em, node, "is not known to act on each selected row alone")


# ------------------------------------------------------------------------- per-row ops
def _rowwise(em: Emitter, node: fx.Node):
    """Every Local operand the same selection, the rest Global and not along the rows: copy, Local."""
    locals_ = [a for a in _flat_args(node) if isinstance(em.layout(a), Local)]
    if any(isinstance(em.layout(a), Sharded) for a in _flat_args(node)):
        return _refuse(em, node, "combines selected rows with the sequence-sharded tokens directly")
    syms = {_rows(a, em.layout(a)) for a in locals_}
    if len(syms) != 1 or None in syms:
        return _refuse(em, node, "combines two different selections of rows")
    (sym,) = syms
    out = _dims_of(node, sym)
    if len(out) != 1 or not _outer_kept(em, node, locals_[0], out[0]):
        return _refuse(em, node, "does not keep the selected rows as one dim")
    lay = em.layout(locals_[0])
    token = lay.token if _key(node) in _KEEP_TOKEN and len(locals_) == 1 else None
    return em.copy(node, *em.value((node.args, node.kwargs))), Local(out[0], token)


def _outer_kept(em: Emitter, node: fx.Node, src: fx.Node, out_dim: int) -> bool:
    """A view keeps rows whole only if the dims before the rows multiply to the same size."""
    if _key(node) not in _VIEWS:
        return True
    lay = em.layout(src)
    before_in = _prod(fake_value(src).shape[:lay.dim])
    before_out = _prod(fake_value(node).shape[:out_dim])
    return before_in == before_out


# ------------------------------------------------------------------------- indexing
def _index(em: Emitter, node: fx.Node):
    """``x[..., top_x, idx, None]`` / ``index_select(x, d, top_x)`` with Local index tensors."""
    x = node.args[0]
    if _key(node) is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    else:
        d = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        index = (slice(None),) * (d % len(global_shape(x))) + (node.args[2] if len(node.args) > 2 else node.kwargs["index"],)
    if isinstance(em.layout(x), Local) and not any(isinstance(i, fx.Node) for i in index):
        return _rowwise(em, node)  # basic indexing of selected rows
    if any(i is Ellipsis for i in index):
        return _refuse(em, node, "indexes with `...` and a selection")
    x_new, why = _source_rows(em, x, index)
    if why:
        return _refuse(em, node, why)
    tensors = [i for i in index if isinstance(i, fx.Node)]
    syms = {_rows(i, em.layout(i)) for i in tensors}
    out = _dims_of(node, next(iter(syms))) if len(syms) == 1 and None not in syms else []
    if len(out) != 1:
        return _refuse(em, node, "indexes with tensors that are not one selection of rows")
    args = (x_new, *em.value(node.args[1:]))
    return em.copy(node, args, em.value(node.kwargs)), Local(out[0])


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
    if lay is None or lay == GLOBAL:
        if size == token[0]:  # one entry per token, held whole: this rank's rows first
            return em.to_sharded(x, dim, token[1]), ""
    return None, (f"indexes dim {dim} of a {tuple(global_shape(x))} tensor ({lay}) with indices into this "
                  f"rank's rows of a token dim of {token[0]} rows (inner {token[1]}), laid out differently")


def _index_add(em: Emitter, node: fx.Node):
    """``out.index_add_(d, top_x, rows)``: rows added back into this rank's rows of a Sharded ``out``."""
    names = ("dim", "index", "source")
    args = list(node.args[1:]) + [node.kwargs[k] for k in names[len(node.args) - 1:] if k in node.kwargs]
    out, (dim, idx, src) = node.args[0], args[:3]
    lay, ilay, slay = em.layout(out), em.layout(idx), em.layout(src)
    if not (isinstance(ilay, Local) and ilay.token is not None and isinstance(slay, Local)):
        return _refuse(em, node, "adds rows by indices that are not token indices of a selection")
    dim = dim % len(global_shape(out))
    if _rows(idx, ilay) != _rows(src, slay) or slay.dim != dim:
        return _refuse(em, node, "adds rows of another selection than its indices")
    out_new, why = _token_source(em, out, dim, ilay.token)
    if why:
        return _refuse(em, node, why)
    new = em.copy(node, (out_new, *em.value(node.args[1:])), em.value(node.kwargs))
    return new, Sharded(dim, ilay.token[1])


# ------------------------------------------------------------------------- helpers
def _rows(node: Any, lay: Local) -> Optional[Any]:
    """The symbol naming a Local value's selection: its unbacked size along the rows."""
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        return None
    size = val.shape[lay.dim]
    return size.node.expr if isinstance(size, torch.SymInt) else None


def _dims_of(node: fx.Node, sym: Any) -> List[int]:
    val = fake_value(node)
    if not isinstance(val, torch.Tensor):
        return []
    return [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == sym]


def _prod(sizes: Any) -> Any:
    out = 1
    for s in sizes:
        out = out * s
    return out


def _refuse(em: Emitter, node: fx.Node, why: str):
    raise CPRewriteError(
        f"cp_compile: {_name(node)} at {source_line(node)} {why}: it reads rows selected by data from this "
        "rank's tokens (torch.where / nonzero), which have no global positions to gather. Fix: act on the "
        "selected rows one by one (per-row ops, index_add_ back by the same indices), or set "
        "torch._dynamo.config.capture_dynamic_output_shape_ops = False so the selection runs between graphs."
    )
