"""This rank's query rows of an explicit attention mask, for the ring op's ``attn_mask``.

Used by the attention rule (:mod:`cp_compile.passes.propagate.rules.attention`) for the mask terms that
:mod:`.masks` could not turn into ``causal``/``window``. The ring op takes this rank's
rows over all keys, additive float32, ``(B|1, H|1, c|1, S_pad)``. Indexing the finished
(B, 1, S, S) mask would build it whole on every rank first, so the row selection is
pushed down through the broadcasting ops that build it, to the operands that really
vary along the query dim:

    before (every rank, O(S²)):  m = (kv <= q) & pad[b, kv]             (B, 1, S, S)
                                 rows = m.index_select(2, pos)           (B, 1, c, S)
    after  (rank r, O(c·S)):     rows = (kv <= q.index_select(2, pos)) & pad[b, kv]

A term that does not vary along the query dim (a key-padding mask ``(B, 1, 1, S)``)
stays that small (the op broadcasts it over the rows): O(B·S) memory. Other terms
are genuinely S x S; they cost O(c·S) per rank and are logged once as a warning that
names the cheaper form.
"""

from __future__ import annotations

import functools

import operator
from functools import reduce
from typing import Any, Dict, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ....ring.masking import additive_mask
from ...context import CPRewriteError, global_shape, log, source_line
from ...op_vocab import MASK_ELEMENTWISE
from ...propagate.placements import Sharded
from ....warn_once import warn_once



def explicit_mask(em: Any, terms: Sequence[fx.Node], sdpa: fx.Node, adds: Sequence[fx.Node] = ()) -> fx.Node:
    """The AND of ``terms`` (old nodes, boolean), plus the float ``adds``, as the ring op's ``attn_mask``:
    additive float32 (B|1, H|1, c|1, S_pad), this rank's rows (1: the same for every row), padding
    keys masked. Memoised per terms, so the layers sharing one mask share its rows."""
    key = ("explicit_mask", tuple(terms), tuple(adds))
    if key in em._memo:
        return em._memo[key]
    memo: Dict[fx.Node, Any] = {}
    parts = []
    if terms:
        parts.append(em.call(additive_mask, reduce(lambda a, b: em.call(operator.and_, a, b),
                                                   [_rows(em, t, memo) for t in terms])))
    parts += [em.call(additive_mask, _rows(em, a, memo)) for a in adds]  # finfo.min -> -inf, float32
    rows = reduce(lambda a, b: em.call(operator.add, a, b), parts)
    shape = torch.broadcast_shapes(*(global_shape(t) for t in (*terms, *adds)))  # global, at most 4-D
    if len(shape) < 4:
        rows = em.call(operator.getitem, rows, (None,) * (4 - len(shape)) + (Ellipsis,))
    # (B|1, H|1, c|1, S|1) float32, -inf where masked
    if shape[-1] != 1 and em.ctx.padded:  # padding keys: never attended (the ring skips them too)
        pad = em.index.op(operator.sub, em.index.S_pad(), em.index.S())
        rows = em.call(F.pad, rows, (0, pad), value=float("-inf"))
    em._memo[key] = em.method("expand", rows, -1, -1, -1, em.index.S_pad())  # a query-only mask: every key
    if any(_varies(em, t) for t in (*terms, *adds)):
        _warn_rows(em, sdpa, shape)
    return em._memo[key]


def _rows(em: Any, old: Any, memo: Dict[fx.Node, Any]) -> Any:
    """The new graph's value of ``old`` restricted to this rank's query rows (dim -2)."""
    if not isinstance(old, fx.Node):
        return old
    if old in memo:
        return memo[old]
    lay = em.layout(old)
    if not _varies(em, old):  # the same for every query row: needed whole
        new = em.to_global(old) if isinstance(lay, Sharded) else em.env[old]
    elif isinstance(lay, Sharded):
        if (lay.dim, lay.inner) != (len(global_shape(old)) - 2, 1):
            raise CPRewriteError(
                f"cp_compile: the attention mask term {old.name} at {source_line(old)} is computed from per-token "
                f"activations sharded along dim {lay.dim}. Fix: build the mask from positions or model inputs only."
            )
        new = em.env[old]  # already this rank's rows
    elif old.op == "call_method" and old.target == "expand":
        new = _expand_rows(em, old, memo)
    elif is_elementwise(old):
        args, kwargs = fx.node.map_aggregate((old.args, old.kwargs), lambda a: _rows(em, a, memo))
        new = em.graph.create_node(old.op, old.target, args, kwargs)
    else:
        new = em.to_sharded(old, len(global_shape(old)) - 2)  # index_select by this rank's positions
    memo[old] = new
    return new


def _varies(em: Any, node: Any) -> bool:
    """Whether ``node`` has its own query rows: size S at dim -2 (in a mask broadcast to
    (..., S, S), every operand has 1 or S there)."""
    shape = global_shape(node) if isinstance(node, fx.Node) else None
    return shape is not None and len(shape) >= 2 and shape[-2] == em.ctx.seq_len != 1


def is_elementwise(node: fx.Node) -> bool:
    """Whether output row i of ``node`` depends only on row i of each operand (``x == 0``, ``a & b``,
    ``m.bool()``; not ``cumsum``, ``expand``). Also used by :mod:`.buffers`."""
    if node.op == "call_method":
        return node.target in MASK_ELEMENTWISE or _aten_pointwise(node.target)
    return node.op == "call_function" and (node.target in MASK_ELEMENTWISE or (
        getattr(node.target, "__module__", "") in _TORCH_MODULES and _aten_pointwise(node.target.__name__)))


_TORCH_MODULES = ("torch", "torch.nn.functional", "torch._C._VariableFunctions", "torch._C._nn", "torch.special")


@functools.lru_cache(maxsize=None)
def _aten_pointwise(name: str) -> bool:
    """Whether every ATen overload of ``name`` (a torch function or Tensor method: abs, exp, clamp,
    tanh, ...) is tagged pointwise and draws no random numbers."""
    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) and not name.endswith("_") else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    tags = [op.tags for op in (getattr(packet, o) for o in packet.overloads()) if _on_tensors(op._schema)]
    return bool(tags) and all(torch.Tag.pointwise in t and torch.Tag.nondeterministic_seeded not in t for t in tags)


def _on_tensors(schema: Any) -> bool:
    """A functional overload from tensors to a tensor (not ``out=``, not the int / float scalar forms)."""
    args, rets = schema.arguments, schema.returns
    return (not schema.is_mutable and bool(args) and str(args[0].type) == "Tensor" and len(rets) == 1
            and str(rets[0].type) == "Tensor")


def _expand_rows(em: Any, node: fx.Node, memo: Dict[fx.Node, Any]) -> fx.Node:
    """``x.expand(*sizes)`` with the query dim's size made this rank's row count."""
    src = node.args[0]
    sizes = list(node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list, torch.Size))
                 else node.args[1:])
    sizes[-2] = -1 if _varies(em, src) else em.index.c()
    return em.method("expand", _rows(em, src, memo), *em.value(sizes))


def _warn_rows(em: Any, sdpa: fx.Node, shape: torch.Size) -> None:
    nbytes = 4 * shape[0] * shape[1] * em.ctx.local_len * em.ctx.padded_len
    msg = (f"cp_compile: the attention mask of scaled_dot_product_attention at {source_line(sdpa)} is an explicit "
           f"{tuple(shape)} mask: each rank builds its {em.ctx.local_len} query rows over all keys "
           f"(O(S^2 / N) memory: {nbytes / 2**20:.3g} MiB per rank here). Cheaper: "
           "is_causal=True (or a causal sliding window built from positions) with no attn_mask; a padding mask "
           "over keys only ((B, 1, 1, S), e.g. Hugging Face's attention_mask) costs O(B·S).")
    warn_once(log, "explicit mask rows", None, "%s", msg)  # once per process: the fix is the same everywhere
