"""Integer index tensors of a graph-built attention mask, as affine functions of positions.

Used by :mod:`.masks`. A value ``Affine(terms, const, sizes)`` stands for the integer
tensor whose entry at index (..., i_-2, i_-1) is ``const + Σ coef · i_dim`` over
``terms`` = ((dim counted from the right, coef), ...). Examples (S = 32, B = 2)::

    arange(32)                              Affine(((-1, 1),), 0)     values 0..31 along dim -1
    arange(32)[None, None, :, None] + 5     Affine(((-2, 1),), 5)     the query index, offset 5
    arange(32).unsqueeze(0).expand(2, -1)   Affine(((-1, 1),), 0)     HF's position_ids (B, S)
    position_ids[:, :1] - 1                 Affine((), -1)            a constant
    diff(position_ids, prepend=that)        Affine((), 1)             every step is 1
    position_ids[batch_idx, q_idx]          Affine(((-2, 1),), 0)     positions looked up by index

Everything else raises ``Unrecognised`` naming the node, so the caller can refuse the
mask with the op and its source line. Nothing here touches data.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch
import torch.fx as fx

from ...context import global_shape
from ...op_vocab import arguments


@dataclass(frozen=True)
class Affine:
    """``const + Σ coef · index(dim)``; ``sizes``: the length of each dim in ``terms``."""

    terms: Tuple[Tuple[int, int], ...]
    const: int
    sizes: Tuple[Tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Flag:
    """A boolean tensor with the same ``value`` everywhere (``position_diff != 1`` above)."""

    value: bool


class Unrecognised(Exception):
    """The mask uses ``node`` in a way the analysis cannot follow (``why`` says how)."""

    def __init__(self, node: fx.Node, why: str) -> None:
        super().__init__(why)
        self.node, self.why = node, why


Eval = Callable[[Any], Any]


def affine(x: Any) -> Affine:
    """A Python int as a constant Affine; Affines unchanged; anything else: not affine (None)."""
    if isinstance(x, Affine):
        return x
    return Affine((), x) if isinstance(x, int) and not isinstance(x, bool) else None


def combine(x: Affine, y: Affine, sign: int) -> Affine:
    """``x + sign * y``."""
    terms = dict(x.terms)
    for d, c in y.terms:
        terms[d] = terms.get(d, 0) + sign * c
    sizes = {**dict(x.sizes), **dict(y.sizes)}
    return Affine(tuple(sorted((d, c) for d, c in terms.items() if c)), x.const + sign * y.const,
                  tuple(sorted(sizes.items())))


def _scale(x: Affine, k: int) -> Affine:
    return Affine(tuple((d, c * k) for d, c in x.terms), x.const * k, x.sizes)


def _move_dims(x: Affine, where: Dict[int, int]) -> Affine:
    return Affine(tuple(sorted((where[d], c) for d, c in x.terms)), x.const,
                  tuple(sorted((where[d], n) for d, n in x.sizes)))


def _arange(node: fx.Node, ev: Eval) -> Affine:
    """``arange(n)`` / ``arange(a, b)`` (step 1): the index of dim -1, plus a."""
    args = list(node.args)
    if node.kwargs.get("step", 1) != 1 or args[2:] or not all(type(a) is int for a in args):
        raise Unrecognised(node, "an arange with a step or a symbolic bound")
    start, end = (0, args[0]) if len(args) == 1 else args
    return Affine(((-1, 1),), start, ((-1, end - start),))


def _add_sub(node: fx.Node, ev: Eval) -> Affine:
    """``x + y`` / ``x - y`` on index tensors and ints."""
    a, b = (affine(ev(v)) for v in node.args[:2])
    if a is None or b is None:
        raise Unrecognised(node, "arithmetic on values that are not positions")
    return combine(a, b, -1 if node.target in (operator.sub, torch.sub, "sub") else 1)


def _expand_ellipsis(index: tuple, nd_in: int) -> tuple:
    if index.count(Ellipsis) != 1:
        return index
    at, used = index.index(Ellipsis), sum(1 for i in index if i is not None and i is not Ellipsis)
    return index[:at] + (slice(None),) * (nd_in - used) + index[at + 1:]


def basic_index(node: fx.Node, x: Affine) -> Affine:
    """``x[None, :, :1, ...]``: new size-1 dims, full slices, one-entry slices and ints."""
    shape, nd_out = global_shape(node.args[0]), len(global_shape(node))
    nd_in = len(shape)
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    index = _expand_ellipsis(index, nd_in)
    index += (slice(None),) * (nd_in - sum(1 for i in index if i is not None))
    coefs, sizes, const = dict(x.terms), dict(x.sizes), x.const
    moved, out_pos, k = {}, 0, 0  # x's dim -> output dim (both from the right), for full slices
    for i in index:
        if i is None:
            out_pos += 1
            continue
        d, k = k - nd_in, k + 1
        if i == slice(None):
            moved[d], out_pos = out_pos - nd_out, out_pos + 1
            continue
        if type(i) is int:
            start = range(shape[d])[i]
        elif isinstance(i, slice):
            start, out_pos = _single_entry(node, i, shape[d]), out_pos + 1
        else:
            raise Unrecognised(node, f"indexing positions with {i!r}")
        const += coefs.pop(d, 0) * start
        sizes.pop(d, None)
    return _move_dims(Affine(tuple(coefs.items()), const, tuple(sizes.items())), moved)


def _single_entry(node: fx.Node, i: slice, size: int) -> int:
    """The start of a slice that keeps exactly one entry (``[:1]``, ``[-1:]``)."""
    if not all(v is None or type(v) is int for v in (i.start, i.stop, i.step)) or len(range(size)[i]) != 1:
        raise Unrecognised(node, f"slicing positions with {i!r}")
    return range(size)[i][0]


def advanced_index(node: fx.Node, x: Affine, ev: Eval) -> Affine:
    """``x[batch_idx, q_idx]`` with one index tensor per dim of x: x's formula at those indices."""
    index = node.args[1]
    nd_in = len(global_shape(node.args[0]))
    if not isinstance(index, tuple) or len(index) != nd_in or not all(isinstance(i, fx.Node) for i in index):
        raise Unrecognised(node, "indexing with tensors that do not address every dim")
    out = Affine((), x.const)
    for d, i in zip(range(-nd_in, 0), index):
        idx = affine(ev(i))
        if idx is None:
            raise Unrecognised(node, "indexing with tensors that are not positions")
        coef = dict(x.terms).get(d, 0)
        out = combine(out, _scale(idx, coef), 1) if coef else combine(out, Affine((), 0, idx.sizes), 1)
    return out


def _unsqueeze(node: fx.Node, ev: Eval) -> Any:
    """``x.unsqueeze(dim)``: dims left of the new one move one further from the right."""
    x = ev(node.args[0])
    if not isinstance(x, Affine):
        return x
    nd_out = len(global_shape(node))
    new = arguments(node, ("input", "dim"))["dim"] % nd_out - nd_out
    return _move_dims(x, {d: d if d > new else d - 1 for d, _ in x.sizes})


def _diff(node: fx.Node, ev: Eval) -> Affine:
    """``diff(x, prepend=x[..., :1] - c, dim=-1)`` of ``x`` with slope c along the last dim: all c."""
    x, dim = affine(ev(node.args[0])), arguments(node, ("input", "n", "dim")).get("dim", -1)
    prepend = affine(ev(node.kwargs["prepend"])) if isinstance(node.kwargs.get("prepend"), fx.Node) else None
    if x is None or prepend is None or dim != -1 or node.kwargs.get("append") is not None:
        raise Unrecognised(node, "a diff other than of positions along the last dim with a prepended start")
    slope = dict(x.terms).get(-1, 0)
    rest = tuple((d, c) for d, c in x.terms if d != -1)
    if prepend.terms != rest or prepend.const != x.const - slope:
        raise Unrecognised(node, "a diff whose first entry differs from the others")
    return Affine((), slope)


def _cumsum(node: fx.Node, ev: Eval) -> Affine:
    """``cumsum`` along the last dim of a constant: 0 stays 0 (HF's packed-sequence ids)."""
    x, dim = ev(node.args[0]), arguments(node, ("input", "dim")).get("dim")
    value = int(x.value) if isinstance(x, Flag) else x.const if isinstance(x, Affine) and not x.terms else None
    if value is None or dim not in (-1, len(global_shape(node)) - 1):
        raise Unrecognised(node, "a cumsum of varying values")
    n = global_shape(node)[-1]
    return Affine(((-1, value),), value, ((-1, n),)) if value else Affine((), 0)


INDEX_HANDLERS: Dict[Any, Callable[[fx.Node, Eval], Any]] = {
    torch.arange: _arange, operator.add: _add_sub, operator.sub: _add_sub, torch.add: _add_sub,
    torch.sub: _add_sub, ("method", "add"): _add_sub, ("method", "sub"): _add_sub,
    ("method", "unsqueeze"): _unsqueeze, torch.unsqueeze: _unsqueeze,
    torch.diff: _diff, ("method", "diff"): _diff, torch.cumsum: _cumsum, ("method", "cumsum"): _cumsum,
}
