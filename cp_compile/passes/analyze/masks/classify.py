"""Split an attention mask built in the graph into what the ring op does by position and the rest.

Hugging Face's sdpa path (``masking_utils.sdpa_mask``) builds boolean masks from index
comparisons rather than passing ``is_causal=True`` whenever it cannot prove the mask
away (a sliding window, an ``attention_mask`` argument, ``torch.compile`` tracing)::

    q = arange(S)[None, None, :, None] + q_offset          # (1, 1, S, 1)
    kv = arange(S)[None, None, None, :] + kv_offset        # (1, 1, 1, S)
    mask = ones(()) & (kv > q - W) & (kv <= q)             # (1, 1, S, S) bool
    mask = mask & attention_mask[b, kv]                    # (B, 1, S, S): key padding
    sdpa(q_states, k_states, v_states, attn_mask=mask.expand(B, -1, S, S))

Without a KV cache HF also checks for packed sequences: ``ids = cumsum(diff(position_ids,
prepend=position_ids[:, :1] - 1) != 1)`` and ``mask &= ids[b, q] == ids[b, kv]``, and
reads positions as ``position_ids[b, q]``; with ``position_ids = arange(S)`` those are
the constant 0 and q again (:mod:`.index` follows them).

The mask's conjunction (``&`` through ``expand``/``to``) is split into its terms. Each
term is first evaluated on abstract values, not on data: integer tensors affine in the
query and key positions (:class:`Affine`) and bounds on ``d = kv - q`` (:class:`Band`).
The recognised terms intersect to one band: ``d <= 0`` over the whole sequence is
causal, no bound is full attention, ``-W < d <= 0`` a sliding window of W keys; these
become the ring op's ``causal`` flag and ``window``, with no S x S tensor. A term read from a
module buffer (nanoGPT's ``bias[:, :, :T, :T] == 0`` of a ``tril`` buffer), or otherwise
computed from constants and gradient-free state only, is evaluated once at compile time and
compared with a band (:mod:`.buffers`)::

    ~(bias[:, :, :S, :S] == 0)         Band(hi=0): causal, as if built from positions

A term ``X[b, q] == X[b, kv]`` comparing one per-position integer tensor X at the query and the
key position is a *document* term (packed sequences, :mod:`.docs`): the ring op takes X itself
(``doc_ids``), and with HF's ids built from ``position_ids`` the positions inside each document
are read as positions (so HF's remapped ``position_ids[b, kv] <= position_ids[b, q]`` is causal)::

    ids[b, q] == ids[b, kv] & (pid[b, kv] <= pid[b, q]) & pad[b, kv]
        ->  causal, doc_ids=ids, explicit [pad[b, kv]]

Every other term (a key-padding mask read from ``attention_mask``, a mask passed in as an
input, a float mask, a buffer that is no band, chunked attention, ...) is kept as an
*explicit* mask: the rewrite computes only this rank's query rows of it
(:mod:`.rows`) and hands them to the ring op.
A band that is none of the three (a bidirectional window, say) makes the whole mask
explicit. So every mask is exact; only the explicit part costs memory.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx

from ...context import fake_value, global_shape, log, source_line
from ...op_vocab import MASK_KEEPING
from ..graph_inputs import user_name
from .buffers import constant_band
from .documents import Doc, doc_term, read_inputs_whole, steps_source
from .index import INDEX_HANDLERS, Affine, Flag, Unrecognised, advanced_index, affine, basic_index, combine
from .lift import Rule, additive_parts, lift_term
from .verify import agrees_with_term

Q_DIM, KV_DIM = -2, -1  # where query and key positions vary in a (B, H, S_q, S_kv) mask


@dataclass(frozen=True)
class Band:
    """A boolean mask ``lo <= kv - q <= hi`` (None: unbounded), broadcast over batch and heads."""

    lo: Optional[int] = None
    hi: Optional[int] = None


Abstract = Union[Affine, Band, Flag, int, float, bool]


@dataclass(frozen=True)
class MaskKind:
    """What a mask means for the ring op: ``causal``; ``window`` W > 0 when each query also
    sees only its W most recent keys (``0 <= q - kv < W``), else -1; ``explicit``: the mask
    terms (old graph nodes, ANDed) the ring op must also apply as a tensor, or (); ``doc_ids``:
    the old node of the per-position document ids X of a term ``X[b, q] == X[b, kv]``, or None;
    ``rules`` / ``scores``: boolean / additive terms that are functions of positions (:mod:`.lift`),
    for the ring op's mask_mod / score_mod."""

    causal: bool
    window: int = -1
    explicit: Tuple[fx.Node, ...] = ()
    doc_ids: Optional[fx.Node] = None
    rules: Tuple[Rule, ...] = ()
    scores: Tuple[Rule, ...] = ()
    explicit_adds: Tuple[fx.Node, ...] = ()  # additive float terms added to the explicit mask (a key-padding
    # ``(1 - mask) * finfo.min`` next to a score rule), this rank's rows


def classify_mask(mask: fx.Node, sdpa: fx.Node, seq_len: int) -> MaskKind:
    """The meaning of the graph-built ``mask`` of ``sdpa`` (see the module docstring)."""
    split = _split_additive(mask, seq_len)  # a float mask: keep terms, score rules, explicit additive terms
    (band, rest), scores, adds = split if split is not None else (_split(mask, {}, seq_len), [], [])
    docs = [t for t in rest if isinstance(t, Doc)]
    if len({d.ids for d in docs}) > 1:  # two different document terms: explicit (exact, O(S^2 / N))
        rest, docs = [t.term if isinstance(t, Doc) else t for t in rest], []
    elif docs:
        band, rest = _within_documents(mask, docs, band, rest, seq_len)
    kind = _band_kind(band, seq_len)
    if kind is None:  # a band the ring op cannot express: the whole mask as one rule of positions, or explicit
        whole = _lifted(mask, seq_len)
        kind, docs, rest, scores, adds = MaskKind(causal=False), [], [whole if whole is not None else mask], [], []
    # a lifted term is a mask_mod if boolean, a score_mod if float (what SDPA makes of the term)
    scores = list(scores) + [t for t in rest if isinstance(t, Rule) and t.additive]
    rules = tuple(t for t in rest if isinstance(t, Rule) and not t.additive)
    explicit = tuple(dict.fromkeys(t for t in rest if not isinstance(t, (Doc, Rule))))  # each term once, in order
    doc_ids = docs[0].ids if docs else None
    if doc_ids is not None:
        read_inputs_whole(mask)  # X and the erased terms are computed from whole inputs (docs.py)
    if explicit or doc_ids is not None or rules or scores or adds:
        log.info("cp_compile: attention at %s: mask %s = %s%s%s%s%s", source_line(sdpa), mask.name,
                 "causal" if kind.causal else "full", f" (window {kind.window})" if kind.window > 0 else "",
                 f", documents {doc_ids.name}" if doc_ids is not None else "",
                 "".join(f", {what} rule {r.term.name}{' (learned)' if r.learned else ''}"
                         for what, rs in (("mask", rules), ("score", scores)) for r in rs),
                 "".join(f", explicit additive {a.name}" for a in adds))
    return MaskKind(kind.causal, kind.window, explicit, doc_ids, rules, tuple(scores), tuple(adds))


def _split_additive(mask: fx.Node, seq_len: int):
    """((band, rest) of the keep terms, score rules, explicit additive terms) of a float mask whose
    additive terms are 0 / -inf bands or functions of positions (:mod:`.lift`), and, next to at least
    one such rule, other additive terms that need no gradient (a key-padding ``(1 - m) * finfo.min``,
    applied as explicit rows); None otherwise (then the float mask is one term, as before: explicit
    unless its values are a band)::

        alibi.masked_fill(kv > q, -inf)   ->  (Band(hi=0), []), [Rule(alibi)], []
        t5_bias + (1 - m) * min           ->  (Band(), []), [Rule(t5_bias)], [(1 - m) * min]"""
    made: List[fx.Node] = []
    parts = additive_parts(mask, lambda target, args, like: _made(made, target, args, like))
    if parts is None:
        return None
    keeps, adds = parts
    band, scores, other = Band(), [], []
    for a in adds:
        bounds = constant_band(a, seq_len) if isinstance(a, fx.Node) else None
        rule = _lifted(a, seq_len) if bounds is None and isinstance(a, fx.Node) else None
        if bounds is None and rule is None:
            other.append(a)
            continue
        band, scores = (_intersect(band, Band(*bounds)), scores) if bounds is not None else (band, scores + [rule])
    if other and (not scores or not all(isinstance(a, fx.Node) and not _requires_grad(a) for a in other)):
        for n in reversed(made):
            mask.graph.erase_node(n)
        return None
    rest: List[Any] = []
    memo: Dict[fx.Node, Abstract] = {}
    for k in keeps:
        b, r = _split(k, memo, seq_len)
        band, rest = _intersect(band, b), rest + r
    return (band, rest), scores, other


def _requires_grad(node: fx.Node) -> bool:
    val = fake_value(node)
    return isinstance(val, torch.Tensor) and val.requires_grad


def _made(made: List[fx.Node], target: Any, args: tuple, like: fx.Node) -> fx.Node:
    """``target(*args)`` in the graph just before ``like``, with its fake value and source line."""
    with like.graph.inserting_before(like):
        node = like.graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "source_fn_stack", "nn_module_stack")})
    node.meta["example_value"] = target(*(fake_value(a) if isinstance(a, fx.Node) else a for a in args))
    made.append(node)
    return node


_OFFSETS = (0, 1 << 20, -(1 << 20))  # offsets of a document's positions: a term read alike at each is exact
_ROW = 1 << 40  # P's rows read apart: a term comparing two rows of P keeps a batch term (not a band)


def _positions(shape: Tuple[int, ...], off: int) -> Affine:
    """P (.., B|1, S) inside a document: ``arange(S) + off``, plus ``_ROW`` times the row index."""
    if len(shape) >= 2 and shape[-2] != 1:
        return Affine(((-2, _ROW), (-1, 1)), off, ((-2, shape[-2]), (-1, shape[-1])))
    return Affine(((-1, 1),), off, ((-1, shape[-1]),))


def _within_documents(mask: fx.Node, docs: List[Doc], band: Band, rest: List[Any], seq_len: int):
    """(band, rest) with HF's ids source P read as ``arange(S) + offset``: exact inside documents,
    where P steps by 1 (:func:`.docs.steps_source`), when the result does not depend on the offset."""
    source = steps_source(docs[0].ids)
    if source is None or not any(isinstance(t, fx.Node) for t in rest):
        return band, rest
    shape = global_shape(source)
    if shape is None or shape[-1] != seq_len:
        return band, rest
    results = []
    for off in _OFFSETS:
        memo: Dict[fx.Node, Any] = {d.term: d for d in docs}
        memo[source] = _positions(shape, off)
        results.append(_split(mask, memo, seq_len))
    ids = {t.ids for t in results[0][1] if isinstance(t, Doc)}
    if any(r != results[0] for r in results) or ids != {docs[0].ids}:
        return band, rest
    return results[0]


def _band_kind(band: Band, seq_len: int) -> Optional[MaskKind]:
    """Causal, full or a causal sliding window; None for any other band."""
    full_lo = band.lo is None or band.lo <= -(seq_len - 1)
    if full_lo and (band.hi is None or band.hi >= seq_len - 1):
        return MaskKind(causal=False)
    if band.hi == 0:
        if full_lo:
            return MaskKind(causal=True)
        if band.lo <= 0:
            return MaskKind(causal=True, window=1 - band.lo)
    return None


_TRANSPARENT = MASK_KEEPING  # methods that keep a boolean mask's meaning


def _split(node: Any, memo: Dict[fx.Node, Abstract], seq_len: int) -> Tuple[Band, List[fx.Node]]:
    """(band of the recognised terms, the other terms) of a mask that is a conjunction. A term
    the abstract evaluation cannot follow gets a band from its values when it reads only constants
    and buffers (:mod:`.buffers`)::

        (kv <= q) & pad[b, kv]          ->  Band(hi=0), [pad[b, kv]]
        ~(bias[:, :, :S, :S] == 0)      ->  Band(hi=0), []             (bias: a tril buffer)
    """
    if isinstance(node, fx.Node) and node.target in _AND_TARGETS:
        (band_a, rest_a), (band_b, rest_b) = (_split(a, memo, seq_len) for a in node.args[:2])
        return _intersect(band_a, band_b), rest_a + rest_b
    if isinstance(node, fx.Node) and node.op == "call_method" and node.target in _TRANSPARENT \
            and isinstance(node.args[0], fx.Node) and _dtype(node) is _dtype(node.args[0]) is torch.bool:
        return _split(node.args[0], memo, seq_len)
    try:
        value = _eval(node, memo)
    except Unrecognised:
        doc = doc_term(node, lambda a: _eval(a, memo), seq_len)
        if doc is not None:
            memo[node] = doc
            return Band(), [doc]
        bounds = constant_band(node, seq_len) if isinstance(node, fx.Node) else None
        if bounds is not None:
            return Band(*bounds), []
        rule = _lifted(node, seq_len) if isinstance(node, fx.Node) else None  # a rule of positions
        return Band(), [rule if rule is not None else node]
    if value == Flag(True) or value is True:
        return Band(), []
    if isinstance(value, Doc):
        return Band(), [value]
    return (value, []) if isinstance(value, Band) else (Band(), [node])


def _eval(arg: Any, memo: Dict[fx.Node, Abstract]) -> Abstract:
    """The abstract value of ``arg`` (a node or a Python constant)."""
    if not isinstance(arg, fx.Node):
        if isinstance(arg, (bool, int, float)):
            return arg
        raise AssertionError(f"unexpected constant {arg!r}")
    if arg in memo:
        return memo[arg]
    if arg.op == "placeholder":
        raise Unrecognised(arg, f"reads the model input '{user_name(arg)}', known only at run time (padding "
                                "in attention_mask, or packed sequences in position_ids)")
    if arg not in memo:
        handler = _HANDLERS.get(("method", arg.target) if arg.op == "call_method" else arg.target)
        if handler is None:
            raise Unrecognised(arg, "which is not a comparison of query and key positions")
        memo[arg] = handler(arg, lambda a: _eval(a, memo))
    return memo[arg]


def _getitem(node: fx.Node, ev) -> Abstract:
    """Indexing positions (index.py); a mask may only gain size-1 dims."""
    x, index = ev(node.args[0]), node.args[1]
    flat = index if isinstance(index, tuple) else (index,)
    if isinstance(x, (Band, Flag)):
        if all(i is None or i is Ellipsis or i == slice(None) for i in flat):
            return x
        raise Unrecognised(node, "indexing into a mask")
    x = affine(x)
    if x is None:
        raise Unrecognised(node, "indexing a value that is not positions")
    if any(isinstance(i, fx.Node) for i in flat):
        return advanced_index(node, x, ev)
    return basic_index(node, x)


def _same(node: fx.Node, ev) -> Abstract:
    """Device moves, expand, contiguous, bool(): the value is unchanged (a mask must stay boolean:
    a 0/1 float mask added to the scores means something else)."""
    x = ev(node.args[0])
    if isinstance(x, (Band, Flag)) and _dtype(node) is not torch.bool:
        raise Unrecognised(node, "a conversion of a boolean mask to numbers")
    return x


def _dtype(node: fx.Node) -> Optional[torch.dtype]:
    val = fake_value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


# -- boolean masks ---------------------------------------------------------------------
def _ones(node: fx.Node, ev) -> Band:
    """``new_ones((), dtype=torch.bool)``: the all-True start of HF's ``and_masks``."""
    if _dtype(node) is not torch.bool:
        raise Unrecognised(node, "a non-boolean constant")
    return Band()


def _compare(node: fx.Node, ev) -> Union[Band, Flag]:
    """``x OP y`` on positions: a bound on kv - q, a bound on one index that always holds, or a constant."""
    a, b = (affine(ev(v)) for v in node.args[:2])
    if a is None or b is None:
        raise Unrecognised(node, "a comparison of values that are not positions")
    diff, op = combine(a, b, -1), _OPS[node.target]  # diff OP 0
    terms = dict(diff.terms)
    if terms == {KV_DIM: -1, Q_DIM: 1}:  # -(kv - q) + c OP 0  <=>  kv - q FLIP(OP) c
        diff, op, terms = Affine(((Q_DIM, -1), (KV_DIM, 1)), -diff.const, diff.sizes), _FLIP[op], {KV_DIM: 1, Q_DIM: -1}
    if terms == {KV_DIM: 1, Q_DIM: -1}:  # kv - q + c OP 0
        bound = -diff.const
        return {"le": Band(hi=bound), "lt": Band(hi=bound - 1), "ge": Band(lo=bound), "gt": Band(lo=bound + 1),
                "eq": Band(bound, bound)}.get(op) or _refuse(node, "a != of positions")
    if not terms:  # e.g. HF's packed-sequence ids compared with themselves
        return Flag(_CONST_OPS[op](diff.const, 0))
    if len(terms) == 1 and _always(diff, op):
        return Band()
    raise Unrecognised(node, "a comparison that is not a bound on key position minus query position")


def _refuse(node: fx.Node, why: str):
    raise Unrecognised(node, why)


def _always(diff: Affine, op: str) -> bool:
    """Whether ``diff OP 0`` holds for every index of its one dim (0 .. size - 1)."""
    ((dim, coef),) = diff.terms
    size = dict(diff.sizes)[dim]
    lo, hi = sorted((diff.const, diff.const + coef * (size - 1)))
    return {"ge": lo >= 0, "gt": lo > 0, "le": hi <= 0, "lt": hi < 0, "ne": lo > 0 or hi < 0}.get(op, False)


def _and(node: fx.Node, ev) -> Band:
    """Conjunction: the intersection of the bands (an all-True constant changes nothing)."""
    a, b = (Band() if isinstance(v, Flag) and v.value else v for v in (ev(x) for x in node.args[:2]))
    if not (isinstance(a, Band) and isinstance(b, Band)):
        raise Unrecognised(node, "a logical and of values that are not masks (or that mask every key)")
    return _intersect(a, b)


def _not(node: fx.Node, ev) -> Union[Band, Flag]:
    """``~m`` of a half-bounded band (``~(kv > q)`` is ``kv <= q``) or of a constant."""
    x = ev(node.args[0])
    if isinstance(x, Flag):
        return Flag(not x.value)
    if isinstance(x, Band) and (x.lo is None) != (x.hi is None):
        return Band(hi=x.lo - 1) if x.lo is not None else Band(lo=x.hi + 1)
    raise Unrecognised(node, "a negation that is not of a one-sided bound on key position minus query position")


def _intersect(a: Band, b: Band) -> Band:
    lo = max((v for v in (a.lo, b.lo) if v is not None), default=None)
    hi = min((v for v in (a.hi, b.hi) if v is not None), default=None)
    return Band(lo, hi)


_OPS = {operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt", operator.eq: "eq",
        operator.ne: "ne", torch.le: "le", torch.lt: "lt", torch.ge: "ge", torch.gt: "gt", torch.eq: "eq",
        torch.ne: "ne"}
_OPS.update({m: m for m in ("le", "lt", "ge", "gt", "eq", "ne")})  # the method forms
_FLIP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}
_CONST_OPS = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq,
              "ne": operator.ne}
_HANDLERS = {
    **INDEX_HANDLERS, operator.getitem: _getitem,
    **{("method", m): _same for m in ("to", "expand", "contiguous", "bool", "float", "half", "bfloat16", "double")},
    ("method", "new_ones"): _ones, torch.ones: _ones,
    **{op: _compare for op in _OPS if not isinstance(op, str)},
    **{("method", m): _compare for m in ("le", "lt", "ge", "gt", "eq", "ne")},
    operator.invert: _not, torch.logical_not: _not, torch.bitwise_not: _not, ("method", "__invert__"): _not,
    ("method", "logical_not"): _not, ("method", "bitwise_not"): _not,
    operator.and_: _and, torch.logical_and: _and, ("method", "__and__"): _and, ("method", "logical_and"): _and,
}
_AND_TARGETS = {k[1] if isinstance(k, tuple) else k for k, h in _HANDLERS.items() if h is _and}  # fx targets


def _lifted(term: fx.Node, seq_len: int) -> Optional[Rule]:
    """The rule of positions of ``term`` (:func:`.lift.lift_term`), used only if it computes the
    tensor it replaces (:func:`.verify.agrees_with_term`); else None (the term stays explicit)."""
    rule = lift_term(term, seq_len)
    return rule if rule is not None and agrees_with_term(rule) else None
