"""Mask terms that are functions of positions: lifted into the ring op's ``mask_mod`` / ``score_mod``.

A term of an attention mask that the band, document and buffer analyses cannot name (an
ALiBi bias, a prefix-LM mask) is often still a *rule of positions*: an elementwise function
of small tensors, each varying along at most one of the query and key dims, built from
``arange``s, Python numbers and gradient-free state. Then the ring op can evaluate it at the
global positions of each ring rectangle (:mod:`cp_compile.ring.mods`, as for FlexAttention)
and no rank ever holds its S x S or c x S values::

    pos = arange(S); slopes = 2 ** (-8 / H * arange(1, H + 1))            # (S,), (H,): leaves
    bias = slopes[:, None, None] * (pos[None, :] - pos[:, None])          # (H, S, S): the term
        -> score_mod(score, b, h, q, kv, slopes4, kv4, q4)
               = score + slopes4[0, h, 0, 0] * (kv4[0, 0, 0, kv] - q4[0, 0, q, 0])

    prefix = (pos[None, :] <= pos[:, None]) | (pos[None, :] < P)          # (S, S) bool
        -> mask_mod(b, h, q, kv, kv4, q4) = (kv4[..kv] <= q4[..q]) | (kv4[..kv] < P)

:func:`lift_term` walks down from the term through elementwise ops, ``expand`` and views
that only add or drop size-1 dims, tracking which dim of each value is the batch, head, query
and key dim of the (B, H, S, S) mask. It stops at the first value that does not vary along
both the query and the key dim: a *leaf*, O(S) at most, computed whole on every rank and
passed to the ring op reshaped to (B|1, H|1, S|1, S|1). The ops above the leaves (the
``body``) are re-run per rectangle on the leaves read at (b, h, q, kv); views and ``expand``
are the identity there. A leaf must read no model input or activation (an input-dependent term
stays explicit); it may require grad (learned ALiBi slopes): the ring op returns its gradient.

A table read whole at a rule of positions is a leaf of its own kind (``whole``), passed as it is::

    bucket = f(pos[None, :] - pos[:, None])                                # (S, S) int, a rule
    bias = embedding(bucket, weight).permute([2, 0, 1]).unsqueeze(0)       # (1, H, S, S): T5's term
        -> score_mod(score, b, h, q, kv, kv4, q4, weight) = score + weight[f(kv4[..kv] - q4[..q]), h]

The body takes (b, h, q_idx, kv_idx) first, then the leaves (read at them) and tables (whole).

:func:`additive_parts` splits a float mask into its boolean keep terms and its additive terms
(``where(keep, a, -inf)``, ``a.masked_fill(m, -inf)``, ``a + b``), so that the causal part of
``alibi.masked_fill(kv > q, -inf)`` stays the ring's causal flag and the bias becomes a score rule.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ...context import fake_value, source_line
from ...op_vocab import VALUE_VIEWS
from ...op_vocab import arguments as op_vocab_arguments
from ..graph_inputs import is_parameter_like
from .rows import is_elementwise

ROLES = (-4, -3, -2, -1)  # batch, head, query, key dims of the (B, H, S_q, S_kv) mask (from the right)
Q, KV = -2, -1
MASKING = -1e30  # an additive fill at or below this masks (HF's finfo.min, -inf)
_VIEWS = VALUE_VIEWS
_EXPANDS = {"expand", "expand_as", "broadcast_to"}
_PERMUTES = {"permute", "transpose", "swapaxes", "swapdims"}
_LOOKUPS = {torch.nn.functional.embedding}  # F.embedding(ids, table): a table lookup at a rule of positions
_LIKE = {"full_like", "zeros_like", "ones_like"}  # one value per element: elementwise
# in-place and two-tensor forms as the functions the body runs on one (b, h, q, kv)
_FUNCTIONAL = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
               operator.itruediv: operator.truediv, torch.min: torch.minimum, torch.max: torch.maximum}
_BINARY = {torch.minimum, torch.maximum}


Bodies = Tuple[Tuple[fx.GraphModule, Tuple[bool, ...]], ...]  # each rule's body and which leaves are tables


@dataclass(frozen=True)
class Rule:
    """A lifted term: ``body`` (a GraphModule of scalars-or-grids -> the term's value) applied to
    ``leaves`` (old nodes) read at (b, h, q, kv); ``shapes``: each leaf's (B|1, H|1, S|1, S|1)."""

    term: fx.Node
    body: fx.GraphModule
    leaves: Tuple[fx.Node, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    whole: Tuple[bool, ...] = ()  # per leaf: a table read whole (its own shape), not at (b, h, q, kv)

    def read_whole(self, i: int) -> bool:
        return bool(self.whole) and self.whole[i]

    @property
    def learned(self) -> bool:
        """Whether a leaf requires grad (a learned table or slopes): a score buffer that trains."""
        return any(_requires_grad(leaf) for leaf in self.leaves)

    @property
    def additive(self) -> bool:
        """Whether the term is added to the scores (a float term: a ``score_mod``) rather than
        selecting keys (a boolean term: a ``mask_mod``). Decided by the term's dtype alone, as
        SDPA decides what its ``attn_mask`` means."""
        val = fake_value(self.term)
        return not (isinstance(val, torch.Tensor) and val.dtype is torch.bool)


def _shape(node: Any) -> Optional[Tuple[int, ...]]:
    val = fake_value(node) if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None  # symbolic sizes: not lifted (the term stays explicit)
    return tuple(val.shape)


def _present(shape: Tuple[int, ...], roles: Dict[int, int]) -> Dict[int, int]:
    """role -> right-counted dim of the roles along which ``shape`` varies (size > 1)."""
    return {r: d for r, d in roles.items() if -d <= len(shape) and shape[d] != 1}


def _requires_grad(node: Any) -> bool:
    val = fake_value(node) if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.requires_grad


def _target(node: fx.Node) -> Any:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)


class _Walk:
    """The body graph under construction and its leaves."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len, self.graph = seq_len, fx.Graph()
        self.env: Dict[fx.Node, fx.Node] = {}
        self.leaves: List[fx.Node] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.whole: List[bool] = []
        self.index = {r: self.graph.placeholder(n) for r, n in zip(ROLES, ("b", "h", "q_idx", "kv_idx"))}

    def visit(self, node: Any, roles: Dict[int, int]) -> Any:
        """The body's value of ``node`` (old), whose dims play ``roles``; None: not liftable."""
        if not isinstance(node, fx.Node):
            return node
        if node in self.env:
            return self.env[node]
        shape = _shape(node)
        if shape is None:
            return None
        present = _present(shape, roles)
        if Q in present and KV in present:
            out = self._op(node, shape, roles)
        else:
            out = self._leaf(node, shape, present)
        if out is not None:
            self.env[node] = out
        return out

    def _leaf(self, node: fx.Node, shape: Tuple[int, ...], present: Dict[int, int]) -> Optional[fx.Node]:
        varying = [d for d in range(-len(shape), 0) if shape[d] != 1]
        if sorted(present.values()) != varying or not _state_only(node):
            return None  # a dim that is no mask dim, or a value that is not whole state
        sizes = [1, 1, 1, 1]
        for role, d in present.items():
            sizes[role] = shape[d]
        return self._placeholder(node, tuple(sizes), whole=False)

    def _placeholder(self, node: fx.Node, shape: Tuple[int, ...], whole: bool) -> fx.Node:
        self.leaves.append(node)
        self.shapes.append(shape)
        self.whole.append(whole)
        return self.graph.placeholder(f"leaf{len(self.leaves) - 1}")

    def _table(self, node: Any) -> Optional[fx.Node]:
        """A lookup table read whole (T5's (num_buckets, H) ``relative_attention_bias.weight``): state,
        learned or not, that no position indexes; its body placeholder."""
        if not isinstance(node, fx.Node) or _shape(node) is None or not _state_only(node):
            return None
        if node in self.env:
            return self.env[node]
        self.env[node] = self._placeholder(node, _shape(node), whole=True)
        return self.env[node]

    def _op(self, node: fx.Node, shape: Tuple[int, ...], roles: Dict[int, int]) -> Optional[fx.Node]:
        """An op whose value spans both position dims: elementwise, expand, or a size-1 view."""
        if node.op not in ("call_function", "call_method"):
            return None
        name = _target(node)
        if node.target in _LOOKUPS or node.target is operator.getitem and isinstance(node.args[1], fx.Node):
            return self._lookup(node, shape, roles)
        if name in _PERMUTES:
            inner = _permute_roles(node, roles)
            return None if inner is None else self.visit(node.args[0], inner)
        if name in _EXPANDS or (name in _VIEWS and node.op == "call_method") or node.target is operator.getitem:
            src = node.args[0]
            inner = _view_roles(node, src, roles) if name not in _EXPANDS else roles
            return None if inner is None else self.visit(src, inner)  # the identity at one (b, h, q, kv)
        target = _FUNCTIONAL.get(node.target, node.target)
        if target in _BINARY and not (len(node.args) == 2 and isinstance(node.args[1], fx.Node) and not node.kwargs):
            return None  # torch.min(x) / torch.min(x, dim): a reduction, not the elementwise minimum
        if not (is_elementwise(node) or target is not node.target or name in _LIKE) or name in ("type_as",):
            return None
        failed = []

        def arg(a: Any) -> Any:
            out = self.visit(a, roles) if isinstance(a, fx.Node) else a
            if out is None and isinstance(a, fx.Node):
                failed.append(a)
            return out

        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), arg)
        if failed:
            return None
        return self.graph.create_node(node.op, target, args, kwargs)

    def _lookup(self, node: fx.Node, shape: Tuple[int, ...], roles: Dict[int, int]) -> Optional[fx.Node]:
        """``embedding(ids, table)`` / ``table[ids]`` with ``ids`` a rule of positions and ``table`` read
        whole: ``table[ids, h]`` at one (b, h, q, kv). A 2-D table's columns are the value's trailing
        dim, which must be the head dim (T5's ``values.permute([2, 0, 1])``) or of size 1::

            values = embedding(bucket(kv - q), weight)     # (S, S, H)     -> weight[bucket, h]"""
        if node.target is operator.getitem:
            table, ids = node.args
        else:
            a = op_vocab_arguments(node, ("input", "weight", "padding_idx", "max_norm"))
            if a.get("max_norm") is not None:
                return None  # max_norm renormalises the table's rows in place as it reads them
            ids, table = a["input"], a["weight"]
        tv, iv = fake_value(table), fake_value(ids)
        if not (isinstance(tv, torch.Tensor) and isinstance(iv, torch.Tensor)) or iv.is_floating_point() \
                or iv.dtype is torch.bool or tv.dim() not in (1, 2):
            return None
        inner = {r: d for r, d in roles.items() if d != -1} if tv.dim() == 2 else dict(roles)
        column = next((r for r, d in roles.items() if d == -1), None) if tv.dim() == 2 else None
        if tv.dim() == 2 and not (column == ROLES[1] or shape[-1] == 1):
            return None  # the table's columns would be read along a dim that is not the heads
        if tv.dim() == 2:
            inner = {r: d + 1 for r, d in inner.items() if -(d + 1) <= iv.dim()}
        body_ids, body_table = self.visit(ids, inner), self._table(table)
        if body_ids is None or body_table is None:
            return None
        at = (body_ids, self.index[ROLES[1]] if column == ROLES[1] else 0) if tv.dim() == 2 else body_ids
        return self.graph.call_function(operator.getitem, (body_table, at))


def _view_roles(node: fx.Node, src: Any, roles: Dict[int, int]) -> Optional[Dict[int, int]]:
    """``roles`` of ``node``'s dims carried to ``src``'s, for a view that keeps the sizes > 1 in order
    (adds or drops size-1 dims only); None for any other view."""
    out, inp = _shape(node), _shape(src)
    if out is None or inp is None or node.target is operator.getitem and not _plain_index(node.args[1]):
        return None
    big_out = [d for d in range(-len(out), 0) if out[d] != 1]
    big_in = [d for d in range(-len(inp), 0) if inp[d] != 1]
    if [out[d] for d in big_out] != [inp[d] for d in big_in]:
        return None
    where = dict(zip(big_out, big_in))
    return {r: where[d] for r, d in roles.items() if -d <= len(out) and d in where}


def _permute_roles(node: fx.Node, roles: Dict[int, int]) -> Optional[Dict[int, int]]:
    """``roles`` of a ``permute`` / ``transpose``'s output dims carried to its input's dims."""
    shape = _shape(node)
    if shape is None:
        return None
    n, name = len(shape), _target(node)
    rest = node.args[1:]
    if name == "permute":
        perm = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    elif name in ("transpose", "swapaxes", "swapdims") and len(rest) == 2:
        perm = list(range(n))
        i, j = (d % n for d in rest)
        perm[i], perm[j] = perm[j], perm[i]
    else:
        return None
    if sorted(p % n for p in perm if isinstance(p, int)) != list(range(n)):
        return None
    return {r: perm[n + d] % n - n for r, d in roles.items() if -d <= n}


def _plain_index(index: Any) -> bool:
    flat = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in flat)


def _state_only(node: fx.Node) -> bool:
    """Whether ``node`` reads no model input or activation: only constants, sizes and state (buffers,
    parameters: learned ones too, whose gradient comes back from the ring op), through pure ops."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        val = fake_value(n)
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor) and not is_parameter_like(n, _example(n)):
                return False
        elif n.op not in ("get_attr", "call_function", "call_method"):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _example(node: fx.Node) -> Any:
    """The tensor Dynamo traced a placeholder with (None when unknown or expired)."""
    try:
        return node.meta["grapharg"].example if node.meta.get("grapharg") is not None else None
    except AssertionError:  # its weak reference expired
        return None


def lift_term(term: fx.Node, seq_len: int) -> Optional[Rule]:
    """The :class:`Rule` of ``term`` (a mask term, boolean or additive), or None when it is not an
    elementwise function of whole O(S) leaves (see the module docstring)."""
    walk = _Walk(seq_len)
    try:
        out = walk.visit(term, {r: r for r in ROLES})
    except (TypeError, ValueError, IndexError):
        return None
    if out is None or not walk.leaves or not isinstance(out, fx.Node):
        return None
    if out.op == "placeholder" and fake_value(term).dtype is torch.bool:
        return None  # a boolean O(S) leaf (a key row) is cheaper as the explicit row it is
    # an additive term that is itself one O(S) leaf (MPT's per-key bias) is a rule: the identity
    walk.graph.output(out)
    return Rule(term, fx.GraphModule(torch.nn.Module(), walk.graph), tuple(walk.leaves), tuple(walk.shapes),
                tuple(walk.whole))


# -- the mods the ring op evaluates ------------------------------------------------------------
def _at(t: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
    """``t`` (B|1, H|1, S|1, S|1) read at (b, h, q, kv); size-1 dims read at 0."""
    idx = tuple(i if n != 1 else 0 for i, n in zip((b, h, q, kv), t.shape))
    return t[idx]


def _bodies(rules: Bodies, b, h, q, kv, leaves) -> List[torch.Tensor]:
    """Each rule's body at (b, h, q, kv): its leaves read there, its tables (``whole``) as they are."""
    out, i = [], 0
    for body, whole in rules:
        n = len(whole)
        read = (t if w else _at(t, b, h, q, kv) for t, w in zip(leaves[i:i + n], whole))
        out.append(body.forward(b, h, q, kv, *read))
        i += n
    return out


def rules_mask(rules: Bodies, b, h, q, kv, *leaves) -> torch.Tensor:
    """mask_mod: the AND of the lifted boolean terms."""
    return functools.reduce(operator.and_, (v.to(torch.bool) for v in _bodies(rules, b, h, q, kv, leaves)))


def rules_score(rules: Bodies, score, b, h, q, kv, *leaves) -> torch.Tensor:
    """score_mod: the score plus every lifted additive term (as SDPA adds attn_mask to the scores)."""
    return functools.reduce(operator.add, (v.to(score.dtype) for v in _bodies(rules, b, h, q, kv, leaves)), score)


def function_then_rules(score_fn: Any, rules: Bodies, score, b, h, q, kv,
                        *leaves) -> torch.Tensor:
    """score_mod: ``score_fn`` of the score (soft-capping, :mod:`..score_fn`), then the lifted terms."""
    return rules_score(rules, score_fn(score), b, h, q, kv, *leaves)


def as_mod(kind: str, rules: Tuple[Rule, ...], sdpa: fx.Node, score_fn: Any = None) -> Any:
    """The mask_mod (``kind`` "mask") or score_mod ("score") of ``rules``, named for the record; a
    score_mod applies ``score_fn`` to the score first, when given."""
    bodies = tuple((r.body, tuple(r.read_whole(i) for i in range(len(r.leaves)))) for r in rules)
    if kind == "score" and score_fn is not None:
        fn = functools.partial(function_then_rules, score_fn, bodies)
    else:
        fn = functools.partial(rules_mask if kind == "mask" else rules_score, bodies)
    where = ":".join(source_line(sdpa).split(":")[:2]).rsplit("/", 1)[-1]
    fn.__name__ = f"lifted from the attn_mask at {where}"
    return fn


# -- float masks: keep terms and additive terms -------------------------------------------------
def _masking_fill(value: Any) -> bool:
    return isinstance(value, (int, float)) and (math.isinf(value) and value < 0 or value <= MASKING)


def _is_float(node: Any) -> bool:
    val = fake_value(node) if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _same_alignment(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is ``src`` with leading size-1 dims added (``x[None]``, ``x.unsqueeze(0)``,
    ``x.view(1, *x.shape)``) or a same-dtype copy: broadcast from the right, the two are one mask."""
    name = _target(node)
    if name not in _VIEWS | {"to", "float", "getitem"} or name == "getitem" and not _plain_index(node.args[1]):
        return False
    a, b = fake_value(node), fake_value(src)
    if a.dtype != b.dtype:
        return False
    strip = lambda shape: tuple(shape)[next((i for i, d in enumerate(shape) if d != 1), len(shape)):]  # noqa: E731
    return strip(a.shape) == strip(b.shape)


def additive_parts(mask: fx.Node, new_node) -> Optional[Tuple[List[fx.Node], List[fx.Node]]]:
    """(boolean keep terms, additive float terms) of a float ``mask``, or None for a boolean mask.
    ``new_node(target, args, like)`` makes the ``~m`` of a ``masked_fill(m, -inf)`` in the graph.

    ``where(keep, a + b, -inf)`` -> ([keep], [a, b]);  ``a.masked_fill(m, -inf)`` -> ([~m], [a])."""
    if not _is_float(mask):
        return None
    keeps: List[fx.Node] = []
    adds: List[fx.Node] = []
    todo = [mask]
    while todo:
        n = todo.pop()
        name = _target(n) if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") else None
        if name in ("add", "__add__") and len(n.args) == 2 and all(_is_float(a) for a in n.args) and not n.kwargs:
            todo += list(n.args)
        elif name == "where" and len(n.args) == 3 and _masking_fill(n.args[2]) and _is_float(n.args[1]):
            keeps.append(n.args[0])
            todo.append(n.args[1])
        elif name == "masked_fill" and len(n.args) == 3 and _masking_fill(n.args[2]) and _is_float(n.args[0]):
            keeps.append(new_node(operator.invert, (n.args[1],), n))
            todo.append(n.args[0])
        elif name is not None and n.args and _is_float(n.args[0]) and _same_alignment(n, n.args[0]):
            todo.append(n.args[0])  # bias[None], bias.to(dtype), bias.contiguous(): the same terms
        else:
            adds.append(n)
    return keeps, adds


__all__ = ["Rule", "additive_parts", "as_mod", "function_then_rules", "lift_term", "rules_mask", "rules_score"]


# -- the rewrite: the ring op's mods and buffers ------------------------------------------------
def ring_mods(em: Any, rules: Tuple[Rule, ...], scores: Tuple[Rule, ...], sdpa: fx.Node,
              score_fn: Any = None) -> Dict[str, Any]:
    """The ring op's ``mods`` / ``mask_buffers`` / ``score_buffers`` for the lifted terms of ``sdpa``'s
    mask, and its function of the scores (``score_fn``): each leaf whole (gathered if the rewrite
    split it: O(S)), reshaped to (B|1, H|1, S|1, S|1)."""
    from ....ring.mods import register_mods

    if not rules and not scores and score_fn is None:
        return {}
    key = register_mods(mask_mod=as_mod("mask", rules, sdpa) if rules else None,
                        score_mod=as_mod("score", scores, sdpa, score_fn) if scores or score_fn is not None
                        else None)
    out: Dict[str, Any] = {"mods": key}
    for name, group in (("mask_buffers", rules), ("score_buffers", scores)):
        if group:
            out[name] = [_leaf_value(em, leaf, shape, r.read_whole(i)) for r in group
                         for i, (leaf, shape) in enumerate(zip(r.leaves, r.shapes))]
    return out


def _leaf_value(em: Any, leaf: fx.Node, shape: Tuple[int, ...], table: bool) -> fx.Node:
    """A leaf whole on every rank, reshaped to (B|1, H|1, S|1, S|1); a table as it is. A leaf that
    requires grad (learned slopes, T5's table) gets its gradient from the ring op's backward: a share
    per rank, summed like any parameter's (the Global gradient contract)."""
    from ...propagate.placements import Sharded

    key = ("lifted_leaf", leaf, shape)
    if key not in em._memo:  # layers sharing one mask share its leaves
        whole = em.to_global(leaf) if isinstance(em.layout(leaf), Sharded) else em.env[leaf]
        em._memo[key] = whole if table else em.method("reshape", whole, shape)
    return em._memo[key]
