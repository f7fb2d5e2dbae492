"""Attention written by hand, recognised: the chain from the product of q and k to the product with v.

Whatever the spelling, this chain is ``scaled_dot_product_attention``::

    P   = q·kᵀ                       q @ kᵀ, matmul, bmm, einsum('..qd,..kd->..qk'),
                                     baddbmm(bias, q, kᵀ, beta=β, alpha=α)  (= α·q·kᵀ + β·bias)
    x   = f(P)                       zero or more, in any order:
                                       x * c, c * x, x / c     c a number, or a tensor constant per query row
                                       x + bias, bias + x, x - bias
                                       x.masked_fill(m, -big), where(keep, x, -big), where(m, -big, x)
                                       casts; views that only regroup the leading (batch, head) dims
                                       g(x): an elementwise function of the scores alone (tanh)
    w   = softmax(x, dim=-1)         F.softmax / torch.softmax / .softmax, any dtype
    w   = casts, inactive dropout, views of the leading dims
    out = w·v                        w @ v, matmul, bmm, einsum('..qk,..kd->..qd')

is ``sdpa(q·t, k, v, attn_mask=Σ aᵢ·biasᵢ (-inf where a keep mask is False), scale=s)`` with
``s`` the product of the numeric scales met between P and the softmax, ``t`` the product of the
tensor scales (per query row, applied to q), and ``aᵢ`` the product of the scales met between
bias i and the softmax (a bias added before a scale is scaled with the scores). A nonlinear
elementwise g (soft-capping's ``c · tanh(s / c)``) makes the scale below it SDPA's and g with
the scales above it the score function of :mod:`.score_fn` (no bias or mask may lie inside g).

:func:`match_attention` returns a :class:`Match` (q, k, v as (lead.., S, D) operands, the scales,
biases and keep masks, the leading dims the SDPA runs on) or the reason the chain is not
attention it can fuse; "" when the softmax is no attention at all. :mod:`.fuse_attention`
emits the SDPA; :mod:`.unsplit` names what stays unfused.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..op_vocab import (ADD, BADDBMM, CASTS, DIV, DROPOUT, EINSUM, MASKED_FILL, MATMUL, MUL, SOFTMAX, SUB, VIEWS,
                       WHERE, arguments, is_, same, tensor)
from .dead_values import live_users

LEARNED_BIAS = ("its bias requires grad and is not a rule of positions over whole learned tables (it is computed "
                "from activations); the ring op applies biases of positions and learned tables only")
MASKING_FILL = -1e4  # a fill at or below this masks its score (exp underflows to 0 next to any real score)


@dataclass
class Operand:
    """q, k or v as SDPA takes it, (lead.., S, D): ``node`` itself, ``node`` transposed on its last
    two dims (``"T"``), or ``node`` permuted by ``einsum(equation, node)``."""

    node: fx.Node
    how: str = ""  # "" | "T" | an einsum equation
    shape: Tuple[Any, ...] = ()  # (lead.., S, D) after ``how``


@dataclass
class Term:
    """A bias added to the scores (``coef · node``) or a boolean mask (``node``; ``keep``: True = attend),
    with the shape of the scores it applies to (``frame``, to regroup its leading dims)."""

    node: fx.Node
    frame: Tuple[Any, ...]
    coef: float = 1.0
    keep: bool = True


@dataclass
class Match:
    """One attention written by hand (see the module docstring); every node of its chain in ``chain``."""

    q: Operand
    k: Operand
    v: Operand
    out: fx.Node  # the final product
    out_how: str = ""  # "" or the einsum equation from (lead.., S, Dv) to the product's layout
    lead: Tuple[Any, ...] = ()  # the softmax's leading dims: what SDPA runs on ((B, H), or (N,) + a head of 1)
    scale: float = 1.0
    row_scales: List[Term] = field(default_factory=list)  # tensor scales per query row, applied to q
    biases: List[Term] = field(default_factory=list)
    keeps: List[Term] = field(default_factory=list)
    chain: List[fx.Node] = field(default_factory=list)
    # f of the scores, outermost op first: (scale applied after the op, the op, its scores argument)
    score_fn: List[Tuple[float, fx.Node, fx.Node]] = field(default_factory=list)
    product_frame: Tuple[Any, ...] = ()  # the shape of q·kᵀ (q and k's leading dims)
    weights_frame: Tuple[Any, ...] = ()  # the shape of w as the product with v reads it (v's leading dims)


def is_softmax(node: Any) -> bool:
    return is_(node, SOFTMAX)


def match_attention(softmax: fx.Node) -> Tuple[Optional[Match], str]:
    """The attention around ``softmax``, or (None, why not; "" when it is not attention at all)."""
    a = arguments(softmax, ("input", "dim"))
    scores = a["input"]
    sv = tensor(scores)
    if sv is None or sv.dim() < 2 or not same(sv.shape[-1], sv.shape[-2]):
        return None, ""
    dim = a.get("dim")
    if not isinstance(dim, int) or dim % sv.dim() != sv.dim() - 1:
        return None, ""
    m, why = _forward(softmax)
    if m is None:
        return None, why
    why = _backward(m, scores)
    if why is not None:
        return None, why
    return _check(m)


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    users = live_users(node)  # a dead copy of the weights is no reader (dead_values.py)
    return users[0] if len(users) == 1 else None


def _forward(softmax: fx.Node) -> Tuple[Optional[Match], str]:
    """From the softmax to the product with v: casts, inactive dropout, views of the leading dims."""
    node, chain = softmax, [softmax]
    while True:
        user = _only_user(node)
        if user is None:
            return None, ("the attention weights (softmax) are also used elsewhere (returned, or regularised)"
                          if len(live_users(node)) > 1 else "")
        if (is_(user, CASTS) or _regroups(user)) and user.args[0] is node:
            node = user
        elif is_(user, DROPOUT) and arguments(user, ("input",))["input"] is node:
            a = arguments(user, ("input", "p", "training"))
            p, training = a.get("p", 0.5), a.get("train" if user.target is torch.dropout else "training", True)
            if not (isinstance(p, (int, float)) and (p == 0 or training is False)):
                return None, f"attention dropout p={p} is active (set it to 0 or call model.eval())"
            node = user
        else:
            return _product_with_v(user, node, chain)
        chain.append(node)


def _product_with_v(user: fx.Node, w: fx.Node, chain: List[fx.Node]) -> Tuple[Optional[Match], str]:
    """The match started at ``user`` = w·v, or why not."""
    if is_(user, MATMUL) and len(user.args) == 2 and not user.kwargs and user.args[0] is w:
        v = user.args[1]
        if tensor(v) is None:
            return None, ""
        m = Match(q=None, k=None, v=Operand(v, "", tuple(tensor(v).shape)), out=user)  # type: ignore[arg-type]
    elif is_(user, EINSUM):
        parsed = _einsum_wv(user, w)
        if parsed is None:
            return None, "its einsum with v is not '..qk,..kd->..qd' over the same leading dims"
        m = parsed
    else:
        return None, ""
    m.weights_frame = tuple(tensor(w).shape)
    m.chain = chain + [user]
    return m, ""


def _regroups(node: fx.Node) -> bool:
    """A view that keeps the last two dims and only regroups the leading ones ((B·H, S, S) <-> (B, H, S, S))."""
    if not is_(node, VIEWS) or not node.args:
        return False
    a, b = tensor(node), tensor(node.args[0])
    return (a is not None and b is not None and a.dim() >= 2 and b.dim() >= 2 and same(a.shape[-1], b.shape[-1])
            and same(a.shape[-2], b.shape[-2]) and same(a.numel(), b.numel()))


def _from_product(node: Any, hops: int = 8) -> bool:
    """Whether ``node`` is (a few ops below) a product: tells the scores from the other operand."""
    if not isinstance(node, fx.Node):
        return False
    if is_(node, MATMUL) or is_(node, EINSUM) or is_(node, BADDBMM):
        return True
    return hops > 0 and any(_from_product(a, hops - 1) for a in node.all_input_nodes)


class _Walk:
    """The state of the walk from the softmax up to q·kᵀ: the scale met so far (numbers, and whether a
    tensor scale was met), and the frame (the scores' shape) at the current node."""

    def __init__(self, m: Match, scores: fx.Node) -> None:
        self.m, self.mult, self.frame = m, 1.0, tuple(tensor(scores).shape)
        m.lead = self.frame[:-2]

    def step(self, node: fx.Node) -> Tuple[Optional[fx.Node], Optional[str]]:
        """(the next node up, None) or (None, why not); (node, None) with node the product ends the walk."""
        if is_(node, CASTS) and _keeps_shape(node, node.args[0]):
            return node.args[0], None
        if _regroups(node):
            self.frame = tuple(tensor(node.args[0]).shape)
            return node.args[0], None
        if is_(node, MUL) or is_(node, DIV):
            return self._scale(node)
        if is_(node, ADD) or is_(node, SUB):
            return self._bias(node)
        if is_(node, MASKED_FILL) or is_(node, WHERE):
            return self._keep(node)
        return self._function(node)

    def _function(self, node: fx.Node) -> Tuple[Optional[fx.Node], Optional[str]]:
        """A nonlinear elementwise function of the scores alone (soft-capping's tanh): the ops below
        it are its argument, the scale met so far is applied after it (``c · tanh(s / c)``)."""
        from ..analyze.masks.rows import is_elementwise

        inputs = node.all_input_nodes
        if len(inputs) != 1 or not is_elementwise(node) or not _from_product(inputs[0]):
            return None, ""
        if self.m.row_scales:
            return None, "it applies a function to scores scaled by a tensor"
        self.m.score_fn.append((self.mult, node, inputs[0]))
        self.mult = 1.0
        return inputs[0], None

    def _scale(self, node: fx.Node) -> Tuple[Optional[fx.Node], Optional[str]]:
        if len(node.args) != 2 or node.kwargs:
            return None, ""
        a, b = node.args
        x, c = (a, b) if _from_product(a) else (b, a)
        if is_(node, DIV) and x is not a:
            return None, "it divides by the scores"
        if isinstance(c, (int, float)) and not isinstance(c, bool):
            if c == 0 or not math.isfinite(c):
                return None, f"its scale {c} is not a finite nonzero number"
            self.mult *= (1.0 / c) if is_(node, DIV) else c
            return x, None
        cv = tensor(c)
        if cv is None or not cv.is_floating_point():
            return None, "its scale is not a number or a float tensor"
        if cv.dim() and not same(cv.shape[-1], 1):
            return None, "its scale differs per key (a tensor varying along the last dim)"
        if self.m.biases or self.m.keeps or self.m.score_fn:
            return None, "it scales the scores by a tensor after adding a bias or a mask, or applying a function"
        if is_(node, DIV):
            return None, "it divides the scores by a tensor"
        self.m.row_scales.append(Term(c, self.frame))
        return x, None

    def _bias(self, node: fx.Node) -> Tuple[Optional[fx.Node], Optional[str]]:
        if len(node.args) != 2 or node.kwargs:
            return None, ""
        a, b = node.args
        x, bias = (a, b) if _from_product(a) else (b, a)
        if is_(node, SUB) and x is not a:
            return None, "it subtracts the scores from a bias"
        bv = tensor(bias)
        if bv is None or not bv.is_floating_point():
            return None, ""
        if bv.requires_grad and not _learned_rule(bias):
            return None, LEARNED_BIAS
        if self.m.row_scales:
            return None, "it adds a bias below a tensor scale"
        if self.m.score_fn:
            return None, "it adds a bias inside a nonlinear function of the scores"
        self.m.biases.append(Term(bias, self.frame, -self.mult if is_(node, SUB) else self.mult))
        return x, None

    def _keep(self, node: fx.Node) -> Tuple[Optional[fx.Node], Optional[str]]:
        if is_(node, MASKED_FILL):
            a = arguments(node, ("input", "mask", "value"))
            x, mask, fill = a["input"], a["mask"], a["value"]
            keep = False
        elif len(node.args) == 3:
            mask, a, b = node.args
            x, fill, keep = (a, b, True) if _masks(b) else (b, a, False)
        else:
            return None, ""
        mv = tensor(mask)
        if mv is None or mv.dtype != torch.bool or not isinstance(x, fx.Node):
            return None, ""
        if self.m.score_fn:
            return None, "it masks the scores inside a nonlinear function of them"
        if not _masks(fill) or not (math.isinf(fill) or fill * self.mult <= MASKING_FILL):
            return None, f"its masked_fill value {fill} does not mask" if isinstance(fill, (int, float)) else ""
        self.m.keeps.append(Term(mask, self.frame, keep=keep))
        return x, None


def _learned_rule(bias: Any) -> bool:
    """A bias that requires grad is fused only when it is a rule of positions over whole learned tables
    (T5's bucketed relative bias, learned ALiBi slopes: :func:`..analyze.masks.verify.learned_bias_lifts`)."""
    from ..analyze.masks.verify import learned_bias_lifts

    return isinstance(bias, fx.Node) and learned_bias_lifts(bias)


def _masks(fill: Any) -> bool:
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= MASKING_FILL


def _keeps_shape(node: fx.Node, src: Any) -> bool:
    a, b = tensor(node), tensor(src)
    return a is not None and b is not None and a.shape == b.shape and a.device == b.device


def _backward(m: Match, scores: fx.Node) -> Optional[str]:
    """Walk from the softmax input up to q·kᵀ, filling ``m``; the reason when it is not fusable."""
    walk, node, below = _Walk(m, scores), scores, []
    while True:
        if not isinstance(node, fx.Node):
            return ""
        if len(live_users(node)) - _dtype_reads(node, m.chain) != 1:  # dead copies are no readers
            return "the attention scores are also used elsewhere"
        below.append(node)
        product = _product_qk(m, node, walk.mult)
        if product is True:
            m.product_frame = walk.frame
            m.chain = list(reversed(below)) + m.chain
            return None
        if product:
            return product
        node, why = walk.step(node)
        if node is None:
            return why


def _dtype_reads(node: fx.Node, chain: List[fx.Node]) -> int:
    """How many of ``node``'s users only read its dtype from inside the chain: HF T5's
    ``softmax(scores.float()).type_as(scores)`` casts the weights back to the scores' dtype."""
    return sum(1 for u in node.users if u in chain and is_(u, {"type_as"}) and len(u.args) == 2
               and u.args[1] is node and u.args[0] is not node)


def _product_qk(m: Match, node: fx.Node, mult: float) -> Any:
    """True when ``node`` is q·kᵀ (then ``m`` gets q, k, the product's scale and baddbmm's bias);
    a reason when it is a product that cannot be fused; False when it is no product."""
    if is_(node, MATMUL) and len(node.args) == 2 and not node.kwargs:
        q, kt = node.args
        if tensor(q) is None or tensor(kt) is None:
            return False
        m.q, m.k, m.scale = _as_is(q), _transposed(kt), mult
        return True
    if is_(node, BADDBMM):
        a = arguments(node, ("input", "batch1", "batch2"))
        bias, q, kt = a["input"], a["batch1"], a["batch2"]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if not all(isinstance(x, (int, float)) for x in (beta, alpha)) or tensor(bias) is None:
            return "its baddbmm's beta or alpha is not a number"
        if beta != 0 and tensor(bias).requires_grad and not _learned_rule(bias):
            return LEARNED_BIAS
        m.q, m.k, m.scale = _as_is(q), _transposed(kt), mult * alpha
        if beta != 0:
            m.biases.append(Term(bias, tuple(tensor(node).shape), mult * beta))
        return True
    if is_(node, EINSUM):
        return _einsum_qk(m, node, mult)
    return False


def _as_is(x: fx.Node) -> Operand:
    return Operand(x, "", tuple(tensor(x).shape))


def _transposed(kt: fx.Node) -> Operand:
    shape = tuple(tensor(kt).shape)
    return Operand(kt, "T", shape[:-2] + (shape[-1], shape[-2]))


# -- einsum ---------------------------------------------------------------------------------------
def einsum_parts(node: fx.Node) -> Optional[Tuple[List[str], str, List[fx.Node]]]:
    """(input subscripts, output subscript, operands) of an einsum node, ``...`` spelled out in
    letters einsum accepts (:func:`.rules.einsum.parse_equation`); None for other forms."""
    from ..propagate.rules.einsum import _operands, parse_equation

    eq, ops = _operands(node)
    if not isinstance(eq, str) or not ops or not all(tensor(o) is not None for o in ops):
        return None
    parsed = parse_equation(eq, [tensor(o).dim() for o in ops])
    if parsed is None or any(len(set(s)) != len(s) for s in parsed[0] + [parsed[1]]):
        return None
    subs, out = parsed
    used = set("".join(subs) + out)
    free = iter(c for c in string.ascii_letters if c not in used)
    letters = {c: c if c in string.ascii_letters else next(free, None) for c in sorted(used)}
    if None in letters.values():
        return None
    return ["".join(letters[c] for c in s) for s in subs], "".join(letters[c] for c in out), ops


def _einsum_qk(m: Match, node: fx.Node, mult: float) -> bool:
    """einsum('..qd,..kd->..qk', q, k) in any letter order: q and k as (lead.., S, D) permutations."""
    parts = einsum_parts(node)
    if parts is None or len(parts[0]) != 2:
        return False
    (a, b), out, (x, y) = parts
    if len(out) < 2:
        return False
    lead, i, j = out[:-2], out[-2], out[-1]
    contracted = [c for c in a if c in b and c not in out]
    if i not in a or i in b or j not in b or j in a or len(contracted) != 1 \
            or set(a) != set(lead) | {i, *contracted} or set(b) != set(lead) | {j, *contracted}:
        return False
    d = contracted[0]
    m.q, m.k, m.scale = _permuted(x, a, lead + i + d), _permuted(y, b, lead + j + d), mult
    return True


def _einsum_wv(node: fx.Node, w: fx.Node) -> Optional[Match]:
    """einsum('..qk,..kd->..qd', w, v) in any letter order (w's dims are (lead.., q, k))."""
    parts = einsum_parts(node)
    if parts is None or len(parts[0]) != 2 or parts[2][0] is not w:
        return None
    (a, b), out, (_, v) = parts
    lead, i, j = a[:-2], a[-2], a[-1]
    d = [c for c in b if c not in a]
    if len(d) != 1 or set(b) != set(lead) | {j, d[0]} or set(out) != set(lead) | {i, d[0]}:
        return None
    m = Match(q=None, k=None, v=_permuted(v, b, lead + j + d[0]), out=node)  # type: ignore[arg-type]
    canonical = lead + i + d[0]
    m.out_how = "" if canonical == out else f"{canonical}->{out}"
    return m


def _permuted(x: fx.Node, sub: str, to: str) -> Operand:
    shape = tensor(x).shape
    size = dict(zip(sub, shape))
    return Operand(x, "" if sub == to else f"{sub}->{to}", tuple(size[c] for c in to))


# -- shapes -----------------------------------------------------------------------------------------
def _check(m: Match) -> Tuple[Optional[Match], str]:
    """The match when q, k and v are one self-attention of one dtype, else why not. The dtype is the
    products' (q·kᵀ's and the output's): an operand in another one was cast by ``torch.autocast``, as a
    product never promotes (float32 q and k after RoPE, a bf16 v), and the SDPA gets it cast the same way."""
    q, k, v, out = m.q.shape, m.k.shape, m.v.shape, tensor(m.out)
    floats = all(tensor(x.node).is_floating_point() for x in (m.q, m.k, m.v))
    if tensor(m.chain[0]).dtype != out.dtype or not (floats and out.is_floating_point()):
        return None, "its products q·kᵀ and w·v differ in dtype (or q, k, v are not floating-point)"
    if not (_lead_equal(q[:-2], k[:-2]) and _lead_equal(m.weights_frame[:-2], v[:-2])):
        return None, "q, k and v differ in their batch or head dims"
    if not (same(_numel(q[:-2]), _numel(m.lead)) and same(_numel(v[:-2]), _numel(m.lead))):
        return None, "the scores' leading dims are not q's and v's"
    S = q[-2]
    if not (same(k[-2], S) and same(v[-2], S) and same(q[-1], k[-1])):
        return None, "it is not self-attention over one sequence (q and k lengths differ)"
    if not (m.scale > 0 and math.isfinite(m.scale)):
        return None, f"its scale {m.scale} is not positive"  # a masked -inf must stay -inf
    if len(m.lead) > 2:
        return None, f"its scores have {len(m.lead) + 2} dims (at most 4 are fused)"
    return m, ""


def _lead_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _numel(dims: Sequence[Any]) -> Any:
    n = 1
    for d in dims:
        n = n * d
    return n


__all__ = ["Match", "Operand", "Term", "einsum_parts", "is_softmax", "match_attention"]
