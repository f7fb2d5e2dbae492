"""One ring call described: what a ``cp_compile::ring_attention_fwd`` / ``_bwd`` node is asked to do.

The attention rules (``passes/propagate/rules/attention.py``, ``rules/flex.py``) emit the ring op
and record its :class:`RingCall` on the node (``facts(node).ring_call``, :func:`emitted_call`);
``cp_compile.passes.ring_call.ring_call`` returns that description, or reads it off the node by
the op's schema, argument by argument *name* (:func:`read_ring_call`), where the node is not the
emitted one (AOTAutograd's graphs, a ring op the user's code called). The record, the cost model
and ``cp-compile explain`` read a ring call only through these, so an argument added to the
schema cannot shift what they read (tests/test_ring_call.py fails instead until it is described
here or in :data:`NOT_DESCRIBED`)::

    ring_attention_fwd(q, k, v, True, 0.125, "0", "zigzag", "p2p", "auto", -1, window=16, doc_ids=ids)
      -> RingCall(causal=True, scale=0.125, group_name="0", load_balance="zigzag", rotate="p2p",
                  kernel="auto", valid_len=-1, timeout=-1.0, mask=MaskForm(window=16, doc_ids=True),
                  positions=False, heads=(4, 2))
      .mask_form == "causal + window 16 + documents";  .gqa_ratio == 2

The tensor operands (q, k, v and the mask tensors) are not described: what each rank holds of
them are graph values (``meta["val"]``), which :func:`ring_arguments` finds by name
(``cp_compile.backend.cost.ring_tensors``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx

from . import ops as _ops  # noqa: F401  (registers the ring ops read below)

RING_FWD = torch.ops.cp_compile.ring_attention_fwd.default
RING_BWD = torch.ops.cp_compile.ring_attention_bwd.default

# Schema arguments that are no field of RingCall / MaskForm, and why (tests/test_ring_call.py checks
# that every argument of both schemas is a field or listed here).
NOT_DESCRIBED: Dict[str, str] = {
    "q": "an operand: its per-rank value is a graph value (backend/cost.py: ring_tensors)",
    "k": "an operand (the cost model reads its per-rank value: ring_tensors)",
    "v": "an operand (the cost model reads its per-rank value: ring_tensors)",
    "dout": "a backward operand",
    "out": "a backward operand",
    "lse": "a backward operand",
    "score_grads": "a backward flag per score buffer: which learned buffers get a gradient (autograd decides, "
                   "from the buffers that require grad; the call is the forward's)",
}


@dataclass(frozen=True)
class MaskForm:
    """What a ring call masks besides the sequence layout (``causal`` is :class:`RingCall`'s).

    Field names are the op's argument names; tensors are described by presence (their
    per-rank sizes are graph values), buffer lists by count."""

    window: int = -1  # > 0 (causal): sliding window of that many keys; -1: none
    attn_mask: bool = False  # an explicit mask tensor (this rank's rows)
    doc_ids: bool = False  # whole (B|1, S) document ids: attention within documents
    mods: str = ""  # the key of registered mask_mod / score_mod (ring/mods.py), "" for none
    mask_mod: str = ""  # the mask_mod's name ("" for none or an unknown key)
    score_mod: str = ""  # the score_mod's name
    mask_buffers: int = 0  # tensors the mask_mod reads (whole, constants)
    score_buffers: int = 0  # tensors the score_mod reads


@dataclass(frozen=True)
class RingCall:
    """One call of the ring op: its options, mask form and heads (its operands are graph values)."""

    causal: bool
    scale: float
    group_name: str
    load_balance: str
    rotate: str
    kernel: str
    valid_len: Optional[int] = -1  # >= 0: positions from there on are padding; -1: none; None: a graph value (S)
    timeout: float = -1.0  # seconds each ring wait may take; -1: the process group's own
    mask: MaskForm = field(default_factory=MaskForm)
    positions: bool = False  # a per-call (N, c) positions table in place of load_balance ("documents" layout)
    heads: Optional[Tuple[int, int]] = None  # (H_q, H_kv) of q and k; None when their values are unknown
    # -- the strategy the rewrite gave the attention (passes/finalize/strategy.py); no op arguments ------
    strategy: str = "ring"  # "ring" | "ulysses" | "2d"
    ulysses: int = 1  # the Ulysses degree u (the ring then runs over N / u ranks)
    why: str = ""  # why this strategy (the options, or auto's prices)

    @property
    def gqa_ratio(self) -> Optional[int]:
        """Query heads per K/V head (1 without grouped-query attention), None when heads are unknown."""
        return None if self.heads is None else self.heads[0] // self.heads[1]

    @property
    def mask_words(self) -> List[str]:
        """``causal``, ``window W``, ``documents``, ``explicit``, ``mask_mod NAME``, ``score_mod NAME``
        (``mods KEY`` for a key not registered in this process), in that order."""
        m = self.mask
        words = ["causal"] if self.causal else []
        words += [f"window {m.window}"] if m.window > 0 else []
        words += ["documents"] if m.doc_ids else []
        words += ["explicit"] if m.attn_mask else []
        if m.mods:
            mods = [f"{kind} {name}" for kind, name in (("mask_mod", m.mask_mod), ("score_mod", m.score_mod)) if name]
            words += mods or [f"mods {m.mods}"]
        return words

    @property
    def mask_form(self) -> str:
        """The words of :attr:`mask_words` joined by `` + ``; ``full`` when there are none."""
        return " + ".join(self.mask_words or ["full"])


def is_ring(node: Any) -> bool:
    """Whether ``node`` calls the ring op (forward or backward)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (RING_FWD, RING_BWD)


def ring_arguments(node: fx.Node) -> Dict[str, Any]:
    """Every argument of a ring op node by its schema name, positional or keyword, defaults filled in."""
    if not is_ring(node):
        raise ValueError(f"cp_compile: {node} does not call the ring op (cp_compile::ring_attention_fwd/_bwd).")
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    unknown = set(node.kwargs) - set(names)
    if unknown or len(node.args) > len(names):
        raise ValueError(f"cp_compile: ring op node {node.name} passes arguments its schema lacks "
                         f"({sorted(unknown) or node.args[len(names):]}): {schema}")
    out: Dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            raise ValueError(f"cp_compile: ring op node {node.name} lacks argument {a.name!r} of {schema}.")
    return out


def read_ring_call(node: fx.Node) -> RingCall:
    """The :class:`RingCall` of a ring op node, read by schema name (heads from q's and k's fake values)."""
    args = ring_arguments(node)
    return _describe(args, _heads(args["q"], args["k"]))


def emitted_call(heads: Optional[Tuple[int, int]], **arguments: Any) -> RingCall:
    """The :class:`RingCall` of the arguments a rule passes to the ring op (by name; the omitted ones
    take the schema's defaults), ``heads`` = (H_q, H_kv) of its q and k."""
    return _describe(arguments, heads)


def _describe(a: Mapping[str, Any], heads: Optional[Tuple[int, int]]) -> RingCall:
    """A :class:`RingCall` of argument values by name (tensors: graph nodes, read by presence)."""
    valid_len, window = a.get("valid_len", -1), a.get("window", -1)
    return RingCall(
        causal=bool(a["causal"]), scale=float(a["scale"]), group_name=str(a["group_name"]),
        load_balance=str(a["load_balance"]), rotate=str(a["rotate"]), kernel=str(a["kernel"]),
        valid_len=valid_len if isinstance(valid_len, int) else None, timeout=float(a.get("timeout", -1.0)),
        mask=_mask_form(a, window), positions=a.get("positions") is not None, heads=heads,
    )


def _mask_form(a: Mapping[str, Any], window: Any) -> MaskForm:
    """The masking arguments as a :class:`MaskForm` (the mods' names looked up by key)."""
    key = str(a.get("mods") or "")
    mask_mod, score_mod = _mod_names(key) if key else ("", "")
    return MaskForm(
        window=window if isinstance(window, int) else -1, attn_mask=a.get("attn_mask") is not None,
        doc_ids=a.get("doc_ids") is not None, mods=key, mask_mod=mask_mod, score_mod=score_mod,
        mask_buffers=_count(a.get("mask_buffers")), score_buffers=_count(a.get("score_buffers")),
    )


def _count(buffers: Any) -> int:
    """How many tensors a ``Tensor[]?`` argument passes (None entries left out)."""
    return sum(b is not None for b in (buffers or ()))


def _heads(q: Any, k: Any) -> Optional[Tuple[int, int]]:
    """(H_q, H_kv) from the fake values of the q and k nodes (B, H, c, D); None when unknown."""
    vals = [n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None for n in (q, k)]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in vals):
        return None
    heads = vals[0].shape[1], vals[1].shape[1]
    return heads if all(isinstance(h, int) for h in heads) else None  # a symbolic head count: unknown


def _mod_names(key: str) -> Tuple[str, str]:
    """The names of the mask_mod and score_mod registered under ``key`` ("" each for an unknown key:
    the op would refuse it at run time)."""
    from .mods import lookup

    try:
        mods = lookup(key)
    except ValueError:
        return "", ""
    return tuple(_fn_name(fn) if fn is not None else "" for fn in (mods.mask_mod, mods.score_mod))


def _fn_name(fn: Any) -> str:
    """A mod's name (a ``functools.partial`` has none unless given one, as rules/flex.py does)."""
    if isinstance(fn, functools.partial) and not hasattr(fn, "__name__"):
        return f"partial of {getattr(fn.func, '__name__', type(fn.func).__name__)}"
    return getattr(fn, "__name__", type(fn).__name__)
