"""Pass 0b: turn attention written by hand into ``scaled_dot_product_attention``.

Older model code and much research code writes attention out, so the graph has no SDPA
and, before this pass, got no context parallelism (:mod:`.unsplit` warned). Here each
such chain is matched in Dynamo's torch-level graph and its last matmul is replaced by
SDPA, so find_attention, the mask analysis and the ring rewrite see it as usual.

Before (q, k, v (B, H, S, D), or (B, S, D) single-head; ``kT`` any (..., D, S) value)::

    scores = q @ k.transpose(-2, -1)                     # or torch.matmul / torch.bmm / k.mT
    scores = scores * c  |  scores / c                   # zero or more; c a Python number
    scores = scores.masked_fill(m, -inf)                 # zero or more masks, in any order:
           | scores + a                                  #   bool m (True = masked), float a
           | torch.where(keep, scores, -inf)             #   bool keep (True = kept)
    w = softmax(scores, dim=-1[, dtype=float32])         # F.softmax / torch.softmax / .softmax
    w = w.to(q.dtype);  w = dropout(w, p=0 | training=False)   # optional
    out = w @ v                                          # (B, H, S, Dv)

After::

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=Π c)

with ``mask`` the AND of the keep masks (``~m``, ``keep``) when every mask is boolean, the
sum of the additive ones otherwise (booleans folded in as ``where(keep, a, -inf)``); no
scale op means ``scale=1.0`` (SDPA's default would be 1/√D). A single mask
``masked_fill(triu(ones(S, S), 1).bool(), -inf)`` (or ``tril(ones(S, S)) == 0``, ``~tril``)
is causal: SDPA gets ``is_causal=True`` and no mask, so the ring op needs no tensor. 3-D
q/k/v are given a head dim of 1 (``unsqueeze(1)`` / ``squeeze(1)``). The new nodes get
fake values and the stack trace of the replaced matmul; the scores, the softmax and the
mask construction that nothing else reads are erased.

Left as written (:mod:`.unsplit` then warns that this graph gets no CP): the S x S
scores or weights used by anything else (returned, regularised, ...); a scale that is
not a number (a tensor, or symbolic under dynamic shapes); a scale after an additive
mask; dropout that is active; an additive mask that requires grad (a learned bias:
the ring op treats masks as constants); q/k/v whose lengths, batch dims or dtypes
differ (cross-attention); scores that are not 3-D or 4-D. A masked_fill with a finite
fill (``finfo.min``, -1e9) becomes a boolean mask: identical except on rows where every
key is masked, which a hand-written softmax spreads uniformly and SDPA does not.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .context import RewriteContext, fake_value, log, source_line
from .fake_emit import FakeEmitter

_MATMUL_FUNCS = {operator.matmul, torch.matmul, torch.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_SOFTMAX_FUNCS = {F.softmax, torch.softmax, torch.nn.functional.softmax}
_CASTS = {"to", "type_as", "float", "half", "bfloat16", "double", "type", "contiguous"}
_MUL = {operator.mul, torch.mul, "mul", operator.imul}
_DIV = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide", operator.itruediv}
_ADD = {operator.add, torch.add, "add", operator.iadd}
_MASKED_FILL = {torch.masked_fill, "masked_fill"}
_WHERE = {torch.where, "where"}
_DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout}
_MASKING_FILL = -1e4  # a fill at or below this masks its score (exp underflows to 0 next to any real score)


def _is(node: Any, targets: set) -> bool:
    """Whether ``node`` is a call of one of ``targets`` (functions, or method names as str)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in targets
    return node.op == "call_function" and node.target in targets


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _tensor(x: Any) -> Optional[torch.Tensor]:
    val = fake_value(x) if isinstance(x, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    return statically_known_true(a == b)


@dataclass
class _Match:
    """One hand-written attention: its inputs, and every node of the chain (in graph order)."""

    q: fx.Node
    kt: fx.Node  # (..., D, S)
    v: fx.Node
    out: fx.Node  # the final matmul
    scale: float = 1.0
    keep: List[Tuple[fx.Node, bool]] = field(default_factory=list)  # (bool mask, True = keep / False = masked)
    additive: List[fx.Node] = field(default_factory=list)
    chain: List[fx.Node] = field(default_factory=list)


def fuse_attention(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace each hand-written attention by SDPA; return how many were."""
    count = 0
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or not _is_softmax(node):
            continue
        match, why = _match(node)
        if match is None:
            if why:
                log.info("cp_compile: softmax at %s is not turned into scaled_dot_product_attention: %s",
                         source_line(node), why)
            continue
        if _replace(gm.graph, match):
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.info("cp_compile: %d hand-written attention(s) turned into scaled_dot_product_attention", count)
    return count


def _is_softmax(node: fx.Node) -> bool:
    return _is(node, _SOFTMAX_FUNCS) or _is(node, {"softmax"})


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _match(softmax: fx.Node) -> Tuple[Optional[_Match], str]:
    """The attention around ``softmax``, or (None, why not; "" when it is not attention at all)."""
    scores = softmax.args[0] if softmax.args else softmax.kwargs.get("input")
    sv, wv = _tensor(scores), _tensor(softmax)
    if sv is None or wv is None or sv.dim() not in (3, 4):
        return None, ""
    dim = _arg(softmax, 1, "dim")
    dtype_at = 3 if softmax.target is F.softmax else 2  # F.softmax(x, dim, _stacklevel, dtype)
    dtype = _arg(softmax, dtype_at, "dtype")
    if dim not in (-1, sv.dim() - 1) or (dtype is not None and dtype not in (torch.float32, torch.float64)):
        return None, ""
    # forward: casts and inactive dropout, then `@ v`
    node, chain = softmax, [softmax]
    while True:
        user = _only_user(node)
        if user is None:
            return None, "the attention weights are also used elsewhere" if len(node.users) > 1 else ""
        if _is(user, _CASTS) and user.args[0] is node and _shape_kept(user, node):
            node = user
        elif _is(user, _DROPOUT) and _arg(user, 0, "input") is node:
            p, training = _arg(user, 1, "p", 0.5), _arg(user, 2, "training" if user.target is not torch.dropout
                                                       else "train", True)
            if not (isinstance(p, (int, float)) and (p == 0 or training is False)):
                return None, f"attention dropout p={p} is active (set it to 0 or call model.eval())"
            node = user
        elif (_is(user, _MATMUL_FUNCS) or _is(user, _MATMUL_METHODS)) and user.args[0] is node \
                and len(user.args) == 2 and not user.kwargs:
            out, v = user, user.args[1]
            break
        else:
            return None, ""
        chain.append(node)
    # backward: masks, scales and casts from the softmax input down to `q @ kT`
    m = _Match(q=None, kt=None, v=v, out=out)  # type: ignore[arg-type]
    scaled_after = False  # a scale op was met walking up: in graph order it follows every mask met from here
    below = []
    node = scores
    while True:
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None, ("the attention scores are also used elsewhere" if isinstance(node, fx.Node) else "")
        below.append(node)
        if below[1:] and not _shape_kept(below[-2], node):  # a mask that broadcasts the scores up
            return None, ""
        if (_is(node, _MATMUL_FUNCS) or _is(node, _MATMUL_METHODS)) and len(node.args) == 2 and not node.kwargs:
            m.q, m.kt = node.args
            break
        if _is(node, _CASTS) and _shape_kept(node, node.args[0]):
            node = node.args[0]
        elif _is(node, _MUL) or _is(node, _DIV):
            a, b = node.args[:2]
            if len(node.args) > 2 or node.kwargs:
                return None, ""
            x, c = (a, b) if isinstance(a, fx.Node) and not isinstance(b, fx.Node) else (b, a)
            if not isinstance(x, fx.Node) or isinstance(c, fx.Node) or not isinstance(c, (int, float)):
                return None, "its scale is not a number (a tensor, or symbolic under dynamic shapes)"
            if c == 0 or (_is(node, _DIV) and x is not a):
                return None, ""
            m.scale *= (1.0 / c) if _is(node, _DIV) else c
            scaled_after = True
            node = x
        elif _is(node, _ADD) and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            x, mask = (a, b) if _comes_from_matmul(a) else (b, a)
            mval = _tensor(mask)
            if mval is None or not mval.is_floating_point():
                return None, ""
            if scaled_after:
                return None, "it scales the scores after adding a mask (the mask would be scaled too)"
            if mval.requires_grad:
                return None, "its additive mask requires grad (a learned bias; the ring op treats masks as constants)"
            m.additive.append(mask)
            node = x
        elif _is(node, _MASKED_FILL) and len(node.args) == 3:
            x, mask, fill = node.args
            if not _masks(fill) or _tensor(mask) is None or _tensor(mask).dtype != torch.bool:
                return None, "" if not isinstance(fill, (int, float)) else f"its masked_fill value {fill} does not mask"
            m.keep.append((mask, False))
            node = x
        elif _is(node, _WHERE) and len(node.args) == 3 and _tensor(node.args[0]) is not None \
                and _tensor(node.args[0]).dtype == torch.bool:
            cond, a, b = node.args
            if isinstance(a, fx.Node) and _masks(b):
                m.keep.append((cond, True))
                node = a
            elif isinstance(b, fx.Node) and _masks(a):
                m.keep.append((cond, False))
                node = b
            else:
                return None, ""
        else:
            return None, ""
    if m.scale <= 0 or not math.isfinite(m.scale):
        return None, f"its scale {m.scale} is not positive"  # a masked -inf must stay -inf
    m.chain = list(reversed(below)) + chain + [out]
    return _check_shapes(m)


def _comes_from_matmul(node: Any, hops: int = 6) -> bool:
    """Whether ``node`` is (a few pointwise ops below) a matmul: tells the scores from the mask in ``a + b``."""
    if not isinstance(node, fx.Node):
        return False
    if _is(node, _MATMUL_FUNCS) or _is(node, _MATMUL_METHODS):
        return True
    return hops > 0 and bool(node.args) and _comes_from_matmul(node.args[0], hops - 1)


def _masks(fill: Any) -> bool:
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= _MASKING_FILL


def _shape_kept(node: fx.Node, src: Any) -> bool:
    a, b = _tensor(node), _tensor(src)
    return a is not None and b is not None and a.shape == b.shape and a.device == b.device


def _check_shapes(m: _Match) -> Tuple[Optional[_Match], str]:
    q, kt, v, out = (_tensor(x) for x in (m.q, m.kt, m.v, m.out))
    if any(t is None for t in (q, kt, v, out)) or not (q.dim() == kt.dim() == v.dim() in (3, 4)):
        return None, ""
    if not (q.dtype == kt.dtype == v.dtype == out.dtype) or not q.is_floating_point():
        return None, "q, k, v and the output differ in dtype"
    lead = [tuple(t.shape[:-2]) for t in (q, kt, v)]
    if not all(len(a) == len(lead[0]) and all(_same(x, y) for x, y in zip(a, lead[0])) for a in lead):
        return None, "q, k and v differ in their batch or head dims"
    L, S = q.shape[-2], kt.shape[-1]
    if not (_same(L, S) and _same(v.shape[-2], S) and _same(q.shape[-1], kt.shape[-2])):
        return None, "it is not self-attention over one sequence (q and k lengths differ)"
    return m, ""


# -- causal masks built with triu / tril ------------------------------------------------------
def _region(node: Any, seq: Any, dead: List[fx.Node]) -> Optional[Tuple[str, int]]:
    """Where a 0/1 mask of shape (1, .., 1, S, S) is true, as ("ge", d): kv - q >= d, or
    ("le", d): kv - q <= d; None when it is not built from triu / tril of ones."""
    val = _tensor(node)
    if val is None or val.dim() < 2 or not all(_same(d, 1) for d in val.shape[:-2]) \
            or not (_same(val.shape[-1], seq) and _same(val.shape[-2], seq)):
        return None
    dead.append(node)
    if _is(node, {"bool", "to", "contiguous", "float", "int", "long", "unsqueeze", "view", "reshape"}) \
            or (_is(node, {operator.getitem}) and _trivial_index(node.args[1])):
        return _region(node.args[0], seq, dead)
    if _is(node, {torch.triu, torch.tril, "triu", "tril"}):
        ones, d = node.args[0], _arg(node, 1, "diagonal", 0)
        if not isinstance(d, int) or not _is(ones, {torch.ones, "new_ones"}) or _region_of_ones(ones, seq) is None:
            return None
        dead.append(ones)
        upper = node.target in (torch.triu, "triu")
        return ("ge", d) if upper else ("le", d)
    inner: Optional[Tuple[str, int]] = None
    if _is(node, {operator.invert, torch.logical_not, "logical_not", "__invert__"}):
        inner = _region(node.args[0], seq, dead)
    elif _is(node, {operator.eq, torch.eq, "eq"}) and node.args[1] == 0 and not isinstance(node.args[1], bool):
        inner = _region(node.args[0], seq, dead)
    if inner is None:
        return None
    op, d = inner
    return ("le", d - 1) if op == "ge" else ("ge", d + 1)


def _region_of_ones(ones: fx.Node, seq: Any) -> Optional[bool]:
    val = _tensor(ones)
    ok = val is not None and val.dim() >= 2 and all(_same(d, 1) for d in val.shape[:-2]) \
        and _same(val.shape[-1], seq) and _same(val.shape[-2], seq)
    return True if ok else None


def _trivial_index(index: Any) -> bool:
    flat = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in flat)


def _causal(m: _Match, seq: Any) -> Optional[List[fx.Node]]:
    """The mask-building nodes when the one mask of ``m`` is exactly causal, else None."""
    if m.additive or len(m.keep) != 1:
        return None
    mask, keep = m.keep[0]
    dead: List[fx.Node] = []
    region = _region(mask, seq, dead)
    if region is None:
        return None
    if not keep:  # the masked region: its complement is kept
        op, d = region
        region = ("le", d - 1) if op == "ge" else ("ge", d + 1)
    return dead if region == ("le", 0) else None


# -- the rewrite ------------------------------------------------------------------------------
def _key(em: FakeEmitter, kt: fx.Node) -> fx.Node:
    """k (..., S, D) from ``kT`` (..., D, S): the transpose's input when kT is one, else kT transposed."""
    nd, given = _tensor(kt).dim(), kt
    while _is(kt, {"contiguous", "clone"}) and len(kt.args) == 1 and not kt.kwargs:  # (k.transpose(..)).contiguous()
        kt = kt.args[0]
    if _is(kt, {"transpose", torch.transpose, "swapaxes", torch.swapaxes}) and len(kt.args) == 3:
        dims = {d % nd for d in kt.args[1:] if isinstance(d, int)}
        if dims == {nd - 2, nd - 1}:
            return kt.args[0]
    if _is(kt, {getattr}) and kt.args[1] in ("mT", "T") and (kt.args[1] == "mT" or nd == 2):
        return kt.args[0]
    if _is(kt, {"permute", torch.permute}):
        perm = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        perm = [p % nd if isinstance(p, int) else None for p in perm]
        if perm == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return kt.args[0]
    return em.method("transpose", given, -2, -1)


def _mask(em: FakeEmitter, m: _Match) -> Optional[fx.Node]:
    """The one attn_mask of all the masks (see the module docstring)."""
    keep = [mask if kept else em.fn(operator.invert, mask) for mask, kept in m.keep]
    if not m.additive:
        out = keep[0] if keep else None
        for k in keep[1:]:
            out = em.fn(operator.and_, out, k)
        return out
    out = m.additive[0]
    for a in m.additive[1:]:
        out = em.fn(operator.add, out, a)
    for k in keep:
        out = em.fn(torch.where, k, out, float("-inf"))
    return out


def _replace(graph: fx.Graph, m: _Match) -> bool:
    """Emit SDPA before the final matmul, reroute its users, erase the dead chain."""
    em = FakeEmitter(graph, m.out, m.q)
    q = _tensor(m.q)
    three_d = q.dim() == 3
    causal_nodes = _causal(m, q.shape[-2])
    try:
        k = _key(em, m.kt)
        mask = None if causal_nodes is not None else _mask(em, m)
        qs, ks, vs = m.q, k, m.v
        if three_d:  # SDPA and the ring take (B, H, S, D): one head
            qs, ks, vs = (em.method("unsqueeze", x, 1) for x in (qs, ks, vs))
            if mask is not None and _tensor(mask).dim() == 3:
                mask = em.method("unsqueeze", mask, 1)
        if mask is not None and _tensor(mask).dtype not in (torch.bool, q.dtype):
            mask = em.method("to", mask, q.dtype)
        out = em.fn(F.scaled_dot_product_attention, qs, ks, vs, attn_mask=mask, dropout_p=0.0,
                    is_causal=causal_nodes is not None, scale=float(m.scale))
        if three_d:
            out = em.method("squeeze", out, 1)
        if _tensor(out).shape != _tensor(m.out).shape:
            raise RuntimeError(f"shape {tuple(_tensor(out).shape)} != {tuple(_tensor(m.out).shape)}")
    except Exception as e:  # a form the fake SDPA refuses (mask shape, dtype): leave the code as written
        em.undo()
        log.info("cp_compile: hand-written attention at %s left as written: %s", source_line(m.out), e)
        return False
    m.out.replace_all_uses_with(out)
    kt_ops = [m.kt]  # kT and the contiguous / transpose it came through
    while _is(kt_ops[-1], {"contiguous", "clone", "transpose", "permute", "swapaxes", torch.transpose,
                           torch.permute, torch.swapaxes, getattr}) and isinstance(kt_ops[-1].args[0], fx.Node):
        kt_ops.append(kt_ops[-1].args[0])
    for node in list(reversed(m.chain)) + kt_ops + (causal_nodes or []):  # users before their inputs
        if not getattr(node, "_erased", False) and not node.users and node.op in ("call_function", "call_method"):
            graph.erase_node(node)
    log.info("cp_compile: hand-written attention at %s became scaled_dot_product_attention%s",
             source_line(m.out), " (causal)" if causal_nodes is not None else "")
    return True
