"""Layout rule for ``torch.einsum``: per-token unless the sequence letter is summed over.

Each dim of each operand has a letter. The letter at a Sharded operand's sequence dim
names the sequence; if the output keeps that letter, every output element depends on
one position only, so each rank computes its positions' outputs from its positions'
inputs::

    before: einsum("bsd,de->bse", x (B, S, D) Sharded(1), W (D, E))  -> (B, S, E)
    after:  einsum("bsd,de->bse", x (B, c, D),            W (D, E))  -> (B, c, E) Sharded(1)

Other operands with the sequence letter that every rank holds whole (Global, size S
there) are indexed by this rank's positions, as the pointwise rule does::

    before: einsum("bsd,sd->bs", x (B, S, D) Sharded(1), pos (S, D) Global)
    after:  einsum("bsd,sd->bs", x (B, c, D), pos.index_select(0, positions) (c, D)) -> Sharded(1)

Gathered (fallback): the sequence letter absent from the output (contracted or reduced:
attention scores, a sum over tokens), repeated within one operand (a diagonal), or
operands sharded along different letters. Spaces, ``...`` and the implicit output
(no ``->``) are supported; both call forms ``einsum(eq, a, b)`` and ``einsum(eq, [a, b])``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ...context import global_shape
from ..placements import Sharded
from .registry import chunk_aware, register_rule


def parse_equation(eq: str, ndims: Sequence[int]) -> Optional[Tuple[List[str], str]]:
    """(one subscript string per operand, output subscripts), with ``...`` spelled out.

    ``ndims`` are the operands' ranks. Ellipsis dims get fresh characters, right-aligned
    across operands as broadcasting aligns them. None if the equation does not match
    the ranks (einsum itself would raise).
    """
    eq = eq.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != len(ndims):
        return None
    used = set(eq) - set(".,->")
    fresh = [c for c in map(chr, range(0x100, 0x200)) if c not in used]
    n_ell = max((nd - len(sub.replace("...", "")) for sub, nd in zip(subs, ndims) if "..." in sub), default=0)
    ell = "".join(fresh[:n_ell])  # the broadcast dims, outermost first
    expanded = []
    for sub, nd in zip(subs, ndims):
        if "..." in sub:
            k = nd - len(sub.replace("...", ""))
            sub = sub.replace("...", ell[n_ell - k:] if k > 0 else "")
        if len(sub) != nd:
            return None
        expanded.append(sub)
    if not arrow:  # implicit output: the broadcast dims, then the letters used once, sorted
        letters = "".join(expanded)
        out = "..." + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    return expanded, out.replace("...", ell)


def _operands(node: fx.Node) -> Tuple[str, List[Any]]:
    """(equation, operands) of ``einsum(eq, a, b)`` or ``einsum(eq, [a, b])``."""
    eq, rest = node.args[0], list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return eq, list(rest[0])
    return eq, rest


@chunk_aware
@register_rule(torch.einsum)
def einsum(em, node: fx.Node):
    """``torch.einsum`` with a Sharded operand (see the module docstring)."""
    eq, ops = _operands(node)
    if not isinstance(eq, str) or node.kwargs:
        return em.fallback(node, "einsum with a non-constant equation or keyword arguments")
    ndims = [len(global_shape(a)) if isinstance(a, fx.Node) and global_shape(a) is not None else 0 for a in ops]
    parsed = parse_equation(eq, ndims)
    if parsed is None:
        return em.fallback(node, f"einsum equation {eq!r} does not match its operands' ranks")
    subs, out = parsed
    seq = {(sub[s.dim], s.inner, s.chunk) for a, sub in zip(ops, subs) if isinstance(s := em.layout(a), Sharded)}
    if len(seq) != 1:
        return em.fallback(node, f"einsum {eq!r} with operands sharded along different letters")
    letter, inner, chunk = seq.pop()
    if letter not in out:
        return em.fallback(node, f"einsum {eq!r} sums over the sequence letter {letter!r} (mixes tokens)")
    if any(sub.count(letter) > 1 for sub in subs):
        return em.fallback(node, f"einsum {eq!r} takes a diagonal over the sequence letter {letter!r}")
    converted: Dict[fx.Node, Any] = {}
    for a, sub in zip(ops, subs):
        if not isinstance(a, fx.Node) or isinstance(em.layout(a), Sharded) or letter not in sub:
            continue
        d = sub.index(letter)
        if global_shape(a)[d] != 1:  # one entry per position: take this rank's
            converted[a] = em.to_sharded(a, d, inner, chunk=chunk)
    args = fx.node.map_aggregate(node.args, lambda a: converted.get(a, em.env[a]) if isinstance(a, fx.Node) else a)
    return em.copy(node, args, {}), Sharded(out.index(letter), inner, chunk=chunk)

