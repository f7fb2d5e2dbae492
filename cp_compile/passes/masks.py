"""Recognise an attention mask built in the graph as causal or full, structurally.

Hugging Face's sdpa path (``masking_utils.sdpa_mask``) builds boolean masks from index
comparisons rather than passing ``is_causal=True`` whenever it cannot prove the mask
away (a sliding window, an ``attention_mask`` argument, ``torch.compile`` tracing)::

    q = arange(S)[None, None, :, None] + q_offset          # (1, 1, S, 1)
    kv = arange(S)[None, None, None, :] + kv_offset        # (1, 1, 1, S)
    mask = ones(()) & (kv > q - W) & (kv <= q)             # (1, 1, S, S) bool
    sdpa(q_states, k_states, v_states, attn_mask=mask.expand(B, -1, S, S))

Without a KV cache HF also checks for packed sequences: ``ids = cumsum(diff(position_ids,
prepend=position_ids[:, :1] - 1) != 1)`` and ``mask &= ids[b, q] == ids[b, kv]``, and
reads positions as ``position_ids[b, q]``; with ``position_ids = arange(S)`` those are
the constant 0 and q again (:mod:`.mask_index` follows them).

Materialising that mask is O(S²) and splitting it by rank is not what ring attention
does. Instead the mask's expression is evaluated on abstract values, never on data:
integer tensors affine in the query and key positions (:class:`Affine`) and
conjunctions of bounds on ``d = kv - q`` (:class:`Band`). A mask that reduces to
``d <= 0`` over the whole sequence is causal, one with no bound is full attention;
both become the ring op's ``causal`` flag and the mask is dropped. ``-W < d <= 0`` is
a sliding window of W keys, passed as the ring op's ``window`` when the op takes one. Anything else (a
sliding window shorter than S, a padding mask read from ``attention_mask``, chunked
attention) is refused with an error naming the op, the source line and the fix.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch
import torch.fx as fx

from .context import CPRewriteError, source_line
from .mask_index import INDEX_HANDLERS, Affine, Flag, Unrecognised, advanced_index, affine, basic_index, combine

Q_DIM, KV_DIM = -2, -1  # where query and key positions vary in a (B, H, S_q, S_kv) mask


@dataclass(frozen=True)
class Band:
    """A boolean mask ``lo <= kv - q <= hi`` (None: unbounded), broadcast over batch and heads."""

    lo: Optional[int] = None
    hi: Optional[int] = None


Abstract = Union[Affine, Band, Flag, int, float, bool]


@dataclass(frozen=True)
class MaskKind:
    """What a recognised mask means for the ring op: ``causal``, and ``window`` W > 0 when each
    query also sees only its W most recent keys (``0 <= q - kv < W``), else -1."""

    causal: bool
    window: int = -1


def classify_mask(mask: fx.Node, sdpa: fx.Node, seq_len: int, windows: bool) -> MaskKind:
    """The meaning of the graph-built ``mask`` of ``sdpa``: causal, full, or (``windows``: the ring
    op takes a window) a causal sliding window.

    Raises CPRewriteError for any other mask (names the op, its source line and the fix).
    """
    band = _band(mask, sdpa)
    full_lo = band.lo is None or band.lo <= -(seq_len - 1)
    if full_lo and (band.hi is None or band.hi >= seq_len - 1):
        return MaskKind(causal=False)
    if band.hi == 0:
        if full_lo:
            return MaskKind(causal=True)
        if windows and band.lo <= 0:
            return MaskKind(causal=True, window=1 - band.lo)
    window = f"a sliding window of {band.hi - band.lo + 1} keys" if band.lo is not None and band.hi is not None \
        else f"keys at kv - q in [{band.lo}, {band.hi}]"
    supported = "causal, full or causal sliding-window" if windows else "causal or full"
    raise CPRewriteError(
        f"cp_compile: the attention mask of scaled_dot_product_attention at {source_line(sdpa)} allows {window} "
        f"per query (sequence length {seq_len}); ring attention supports {supported} attention only. "
        "Fix: a window of at least the sequence length (e.g. config.sliding_window=None or >= S), "
        "or run this model without context parallelism."
    )


def _band(mask: fx.Node, sdpa: fx.Node) -> Band:
    """The mask as a band of kv - q, or CPRewriteError naming the op the analysis cannot follow."""
    memo: Dict[fx.Node, Abstract] = {}
    try:
        band = _eval(mask, memo)
    except Unrecognised as e:
        how = e.why if e.node.op == "placeholder" else \
            f"is built by {_op_name(e.node)} (node {e.node.name}) at {source_line(e.node)}, {e.why}"
        raise CPRewriteError(
            f"cp_compile: the attention mask of scaled_dot_product_attention at {source_line(sdpa)} {how}. "
            "Ring attention takes causal or full attention only. Fix: call the model without the input the "
            "mask is built from (attention_mask when no token is padding, position_ids when sequences are not "
            "packed), or pass is_causal=True and no attn_mask."
        ) from None
    band = Band() if band == Flag(True) else band
    if not isinstance(band, Band):
        raise CPRewriteError(f"cp_compile: the attention mask at {source_line(sdpa)} is not a boolean mask of "
                             "query and key positions. Fix: pass is_causal=True and no attn_mask.")
    return band


def _op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _eval(arg: Any, memo: Dict[fx.Node, Abstract]) -> Abstract:
    """The abstract value of ``arg`` (a node or a Python constant)."""
    if not isinstance(arg, fx.Node):
        if isinstance(arg, (bool, int, float)):
            return arg
        raise AssertionError(f"unexpected constant {arg!r}")
    if arg.op == "placeholder":
        from .seq_inputs import user_name

        raise Unrecognised(arg, f"reads the model input '{user_name(arg)}', known only at run time (padding "
                                "in attention_mask, or packed sequences in position_ids)")
    if arg not in memo:
        handler = _HANDLERS.get(("method", arg.target) if arg.op == "call_method" else arg.target)
        if handler is None:
            raise Unrecognised(arg, "which is not a comparison of query and key positions")
        memo[arg] = handler(arg, lambda a: _eval(a, memo))
    return memo[arg]


def _getitem(node: fx.Node, ev) -> Abstract:
    """Indexing positions (mask_index.py); a mask may only gain size-1 dims."""
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
    val = node.meta.get("example_value", node.meta.get("val"))
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
    operator.and_: _and, torch.logical_and: _and, ("method", "__and__"): _and, ("method", "logical_and"): _and,
}
