"""Document terms of an attention mask: ``X[b, q] == X[b, kv]`` for per-position ids X.

Packed batches keep attention inside each document with a mask term that compares one
integer tensor X (B|1, S) read at the query position and at the key position::

    ids[batch_idx, q_idx] == ids[batch_idx, kv_idx]       Hugging Face (masking_utils), advanced indexing
    (doc[:, :, None] == doc[:, None, :])[:, None]         hand-written, broadcasting (B, 1, S, S)
    doc.unsqueeze(-1) == doc.unsqueeze(-2)                the same with unsqueeze

Whatever computes X (an input, HF's ``cumsum(diff(position_ids) != 1)``, a ``searchsorted``
of ``cu_seqlens``, ...), the ring op can apply the term from X alone: ``doc_ids=X`` (4-8
bytes a token, whole on every rank), no S x S tensor. :func:`doc_term` recognises the term
(:mod:`.classify` calls it on each term of a mask's conjunction it cannot read as positions).

Hugging Face also remaps positions inside each document (``position_ids[b, kv] <=
position_ids[b, q]`` instead of ``kv <= q``). When X is built from P as
``cumsum(diff(P, prepend=...) != 1)`` (:func:`steps_source`), P steps by exactly 1 inside a
document, so there ``P[i] = i + (an offset fixed per document)``: :mod:`.classify` reads P as
``arange(S) + offset`` in the terms ANDed with the document term and keeps what does not
depend on the offset (causal, windows).

X must be computed from whole values on every rank. A mask's construction reads model inputs
that the rewrite may shard (position_ids feeds RoPE), and HF's cumsum mixes tokens, which
would gather the sequence (a fallback) on the sharded value. :func:`read_inputs_whole` routes
the mask-only reads of each input through :func:`whole`, whose rule (``whole_rule`` in
:mod:`..rules.attention`) hands the mask the whole input every rank already holds
(``inputs="full"``) or all-gathers a local shard of it (``inputs="local"``: S integers).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Set

import torch
import torch.fx as fx

from ...context import CPRewriteError, fake_value, global_shape, source_line
from ...propagate.placements import Sharded
from ...op_vocab import EQ, IDS_KEEPING, MASK_KEEPING, SDPA_PARAMS, SDPA_TARGETS, arguments
from .index import INDEX_HANDLERS, Affine, Unrecognised, basic_index

_EQ, _KEEP_IDS, _KEEP_MASK = EQ, IDS_KEEPING, MASK_KEEPING
Q_DIM, KV_DIM, BATCH_DIM = -2, -1, -4  # of the (B, H, S, S) mask attention broadcasts a term to


def whole(x: torch.Tensor) -> torch.Tensor:
    """Identity; marks a mask's read of ``x`` as needing the whole value on every rank (its rule:
    ``cp_compile.passes.propagate.rules.attention.whole_rule``)."""
    return x


@dataclass(frozen=True)
class Doc:
    """A document term of a mask: ``term`` (old node) is ``ids[b, q] == ids[b, kv]``."""

    ids: fx.Node
    term: fx.Node


def _target(node: fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _is_integer(node: fx.Node) -> bool:
    val = fake_value(node)
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and not val.dtype.is_complex \
        and val.dtype is not torch.bool


# A document lookup ``X[b, pos]`` or a document term is tracked as an Affine whose terms name dims
# (counted from the right) by coefficient: 1 and 3 the position dims (q / kv), 2 the batch dim.
_POS_A, _BATCH, _POS_B = 1, 2, 3


def _dims(x: Affine) -> dict:
    return {c: d for d, c in x.terms}


def _lookup(node: Any, ev: Callable[[Any], Any], seq_len: int, coef: int) -> Optional[tuple]:
    """``(X, encoding)`` when ``node`` is X read at one position dim (and its batch dim), else None."""
    if not isinstance(node, fx.Node) or not _is_integer(node):
        return None
    shape = global_shape(node)
    if node.op == "call_method" and node.target in _KEEP_IDS:
        src = node.args[0]
        if not isinstance(src, fx.Node) or not _is_integer(src) \
                or fake_value(src).dtype.itemsize > fake_value(node).dtype.itemsize:
            return None  # a narrowing conversion could make different ids equal
        return _lookup(src, ev, seq_len, coef)
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(isinstance(i, fx.Node) for i in index):
            return _advanced(node, index, ev, seq_len, coef)
        inner = _lookup(node.args[0], ev, seq_len, coef)
        return None if inner is None else _moved(inner, lambda x: basic_index(node, x))
    if _target(node) in ("unsqueeze", torch.unsqueeze):
        inner = _lookup(node.args[0], ev, seq_len, coef)
        handler = INDEX_HANDLERS[("method", "unsqueeze")]
        return None if inner is None else _moved(inner, lambda x: handler(node, lambda _: x))
    if shape is None or len(shape) not in (1, 2) or shape[-1] != seq_len:  # the ids themselves: (B|1, S) or (S,)
        return None
    terms = ((-2, _BATCH), (-1, coef)) if len(shape) == 2 and shape[0] != 1 else ((-1, coef),)
    return node, Affine(terms, 0, tuple((d, shape[d]) for d, _ in terms))


def _advanced(node: fx.Node, index: tuple, ev, seq_len: int, coef: int) -> Optional[tuple]:
    """``X[batch_idx, pos_idx]`` (X 2-D) or ``X[pos_idx]`` (X 1-D) with arange index tensors."""
    ids = node.args[0]
    shape = global_shape(ids)
    if shape is None or len(index) != len(shape) or shape[-1] != seq_len or not _is_integer(ids):
        return None
    try:
        idx = [ev(i) if isinstance(i, fx.Node) else i for i in index]
    except Unrecognised:
        return None
    if not all(isinstance(i, Affine) and i.const == 0 and (not i.terms or (len(i.terms) == 1 and i.terms[0][1] == 1))
               for i in idx):
        return None  # each index: an arange along one dim, or the constant 0
    pos, sizes = idx[-1], {}
    for i in idx:
        sizes.update(i.sizes)
    if not pos.terms or sizes.get(pos.terms[0][0]) != seq_len:
        return None
    terms = [(pos.terms[0][0], coef)]
    if len(shape) == 2 and shape[0] != 1:
        if not idx[0].terms or sizes.get(idx[0].terms[0][0]) != shape[0]:
            return None
        terms.append((idx[0].terms[0][0], _BATCH))
    elif len(shape) == 2 and idx[0].terms and sizes.get(idx[0].terms[0][0]) != 1:
        return None  # one row of ids read at batch rows other than 0
    if len({d for d, _ in terms}) != len(terms):
        return None
    return ids, Affine(tuple(sorted(terms)), 0, tuple(sorted((d, sizes[d]) for d, _ in terms)))


def _moved(found: tuple, move: Callable[[Affine], Any]) -> Optional[tuple]:
    ids, enc = found
    try:
        out = move(enc)
    except Unrecognised:
        return None
    if not isinstance(out, Affine) or sorted(c for _, c in out.terms) != sorted(c for _, c in enc.terms):
        return None  # a dim the lookup needs was indexed away
    return ids, out


def doc_term(node: Any, ev: Callable[[Any], Any], seq_len: int) -> Optional[Doc]:
    """The :class:`Doc` that ``node`` (a boolean mask term) is, or None (see the module docstring)."""
    found = _doc_eq(node, ev, seq_len)
    if found is None:
        return None
    ids, enc = found
    dims = _dims(enc)
    if {dims.get(_POS_A), dims.get(_POS_B)} != {Q_DIM, KV_DIM} or dims.get(_BATCH, BATCH_DIM) != BATCH_DIM:
        return None
    return Doc(ids, node)


def _doc_eq(node: Any, ev, seq_len: int) -> Optional[tuple]:
    """(X, encoding of the two position dims and the batch dim) of an equality term, through views."""
    if not isinstance(node, fx.Node):
        return None
    val = fake_value(node)
    if not isinstance(val, torch.Tensor) or val.dtype is not torch.bool:
        return None
    if _target(node) in _EQ and node.op != "call_module":
        return _eq_lookups(node, ev, seq_len)
    return _doc_eq_view(node, ev, seq_len)


def _eq_lookups(node: fx.Node, ev: Callable[[Any], Any], seq_len: int) -> Optional[tuple]:
    """``X[.., pos_a] == X[.., pos_b]``: one ids tensor X read at two position dims (sharing the batch dim,
    if any, and no other dim), as (X, their joint encoding); else None."""
    a, b = (_lookup(x, ev, seq_len, c) for x, c in zip(node.args[:2], (_POS_A, _POS_B)))
    if a is None or b is None or a[0] is not b[0]:
        return None
    da, db = _dims(a[1]), _dims(b[1])
    if da.get(_BATCH) != db.get(_BATCH):
        return None
    terms, sizes = dict(a[1].terms), dict(a[1].sizes)
    terms.update(b[1].terms)
    sizes.update(b[1].sizes)
    if len(set(terms)) != len(a[1].terms) + len(b[1].terms) - (_BATCH in da):  # q and kv on one dim
        return None
    return a[0], Affine(tuple(sorted(terms.items())), 0, tuple(sorted(sizes.items())))


def _doc_eq_view(node: fx.Node, ev: Callable[[Any], Any], seq_len: int) -> Optional[tuple]:
    """An equality term seen through a mask-keeping method, a basic index or an unsqueeze: its
    encoding moved along with the dims; None for any other node."""
    if node.op == "call_method" and node.target in _KEEP_MASK:
        return _doc_eq(node.args[0], ev, seq_len)
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(isinstance(i, fx.Node) for i in index):
            return None
        inner = _doc_eq(node.args[0], ev, seq_len)
        return None if inner is None else _moved(inner, lambda x: basic_index(node, x))
    if _target(node) in ("unsqueeze", torch.unsqueeze):
        inner = _doc_eq(node.args[0], ev, seq_len)
        handler = INDEX_HANDLERS[("method", "unsqueeze")]
        return None if inner is None else _moved(inner, lambda x: handler(node, lambda _: x))
    return None


def steps_source(ids: fx.Node) -> Optional[fx.Node]:
    """P when ``ids`` is ``cumsum(diff(P, prepend=..., dim=-1) != 1, -1)`` (HF's packed-sequence ids),
    through ``expand`` / conversions of P; else None. Equal ids then mean P steps by 1 between."""
    node = ids
    while node.op == "call_method" and node.target in _KEEP_IDS:
        node = node.args[0]
    if _target(node) not in (torch.cumsum, "cumsum"):
        return None
    dim = arguments(node, ("input", "dim")).get("dim")
    flags = node.args[0]
    if dim not in (-1, len(global_shape(node)) - 1) or not isinstance(flags, fx.Node):
        return None
    while flags.op == "call_method" and flags.target in ("to", "int", "long"):
        flags = flags.args[0]
    if _target(flags) not in (operator.ne, torch.ne, "ne") or flags.args[1] != 1:
        return None
    diff = flags.args[0]
    if not isinstance(diff, fx.Node) or _target(diff) not in (torch.diff, "diff"):
        return None
    d_dim = arguments(diff, ("input", "n", "dim")).get("dim", -1)
    if d_dim != -1 or diff.kwargs.get("append") is not None or global_shape(diff) != global_shape(diff.args[0]):
        return None
    return base(diff.args[0])


def base(node: Any) -> Any:
    """``node`` without ``expand`` / ``to`` / ``contiguous`` (which keep the values of positions)."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("expand", "to", "contiguous"):
        node = node.args[0]
    return node


# -- whole values for the mask's construction --------------------------------------------------------
def read_inputs_whole(mask: fx.Node) -> None:
    """Route the reads of graph inputs by nodes that only build attention masks through :func:`whole`,
    so the rewrite computes the mask's ingredients (X) from whole inputs; idempotent."""
    graph = mask.graph
    mask_only = _mask_only(mask)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for p in [n for n in graph.nodes if n.op == "placeholder"]:
        readers = [u for u in p.users if u in mask_only and u.target is not whole]
        if not readers or not isinstance(fake_value(p), torch.Tensor) or fake_value(p).requires_grad:
            continue
        with graph.inserting_before(first):
            w = graph.call_function(whole, (p,))
        w.meta = {k: v for k, v in p.meta.items() if k in ("example_value", "val", "tensor_meta")}
        w.meta["stack_trace"] = readers[0].meta.get("stack_trace")
        for u in readers:
            u.replace_input_with(p, w)


def _mask_only(mask: fx.Node) -> Set[fx.Node]:
    """``mask`` and its ancestors whose every use ends in an attention's attn_mask."""
    todo, seen = [mask], set()
    while todo:
        n = todo.pop()
        if n not in seen and n.op in ("call_function", "call_method"):
            seen.add(n)
            todo.extend(n.all_input_nodes)
    changed = True
    while changed:
        changed = False
        for n in list(seen):
            if not all(u in seen or _reads_as_mask(u, n) for u in n.users):
                seen.discard(n)
                changed = True
    return seen


def _reads_as_mask(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` is an attention that reads ``node`` only as its attn_mask."""
    if user.op != "call_function" or user.target not in SDPA_TARGETS:
        return False
    mask = arguments(user, SDPA_PARAMS).get("attn_mask")
    qkv = list(user.args[:3]) + [user.kwargs.get(k) for k in ("query", "key", "value")]
    return mask is node and node not in qkv


def doc_ids_value(em: Any, ids: fx.Node, sdpa: fx.Node) -> fx.Node:
    """The new graph's whole document ids for the ring op: (B|1, S) int32 or int64."""
    if isinstance(em.layout(ids), Sharded):
        raise CPRewriteError(
            f"cp_compile: the document ids {ids.name} of the attention mask at {source_line(sdpa)} are computed "
            f"from values split by sequence ({source_line(ids)}), and the ring op needs every position's id on "
            "every rank. Fix: compute the document ids from model inputs only (position_ids, document ids, "
            "cu_seqlens), not from activations.")
    new = em.env[ids]
    if len(global_shape(ids)) == 1:
        new = em.method("unsqueeze", new, 0)  # (S,) -> (1, S)
    if fake_value(ids).dtype not in (torch.int32, torch.int64):
        new = em.method("to", new, torch.int64)
    return new
