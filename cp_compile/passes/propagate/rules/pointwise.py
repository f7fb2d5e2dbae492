"""Layout rules for pointwise (broadcasting) ops, per-token ops and matmuls (docs/design.md §6).

    x (B, S/N, D) Sharded(1) + pos (1, S, D) Global    -> pos indexed by this rank's positions -> Sharded(1)
    linear / layer_norm / embedding / softmax(-1) of Sharded(1)   -> Sharded(1)
    x (B, S/N, D) @ W (D, E)                                     -> Sharded(1)   (tokens in the left side's rows)
    inv_freq (D/2, 1) @ position_ids (1, S/N)                    -> Sharded(1)   (tokens in the right side's columns)
"""

from __future__ import annotations

import operator
from typing import Any, Dict

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...context import global_shape
from ...op_vocab import EMBEDDING, NORMS, PER_TOKEN, POINTWISE, SOFTMAXES, arguments
from ..emitter import Emitter
from ..placements import Sharded
from .common import _flat_args, _map, _name, _ndim, _norm, _sharded
from .registry import chunk_aware, register_rule, window_aware

@chunk_aware
@window_aware
@register_rule(*(POINTWISE - {torch.where}))  # torch.where: the selection form too (routing.py)
def pointwise(em: Emitter, node: fx.Node):
    """Elementwise on broadcast operands: the sharded dim aligned; whole operands with size S there indexed.

    Windowed operands (slices of the sequence) share one window (a, n), or are aligned to the first's by a
    halo (``h[:, 1:] - h[:, :-1]`` pairs position p with p - 1: :func:`_align_windows`); a whole operand
    of size n there is read at p - a."""
    out_nd = _ndim(node)
    tensors = [a for a in _flat_args(node) if isinstance(a, fx.Node) and global_shape(a) is not None]
    targets = {(s.dim + out_nd - _ndim(a), s.inner, s.window) for a in tensors if (s := _sharded(em, a))}
    chunks = {s.chunk for a in tensors if (s := _sharded(em, a))}
    if len(chunks) != 1:
        return em.fallback(node, "the sequence in tokens combined with the sequence in chunks")
    (chunk,) = chunks
    converted: Dict[fx.Node, Any] = {}
    if len(targets) != 1:
        windows = {t[2] for t in targets}
        if len(windows) == 1:
            return em.fallback(node, "sharded operands along different dims")
        aligned = _align_windows(em, tensors, targets)
        if isinstance(aligned, str):
            return em.fallback(node, f"slices of the sequence with different windows {sorted(windows, key=str)} "
                               f"combined: {aligned}")
        converted, targets = aligned
    out_dim, inner, window = targets.pop()
    if window is not None and global_shape(node)[out_dim] != window[1]:  # a window of 1 broadcast to more rows
        return em.fallback(node, "a slice of the sequence broadcast along its own dim")
    for a in tensors:
        if _sharded(em, a):
            continue
        d = out_dim - (out_nd - _ndim(a))
        if d >= 0 and global_shape(a)[d] != 1:
            converted[a] = em.to_sharded(a, d, inner, window, chunk)  # one entry per position: this rank's
    args, kwargs = _map(em, node, converted)
    return em.copy(node, args, kwargs), Sharded(out_dim, inner, window, chunk)


def _align_windows(em: Emitter, tensors: list, targets: set) -> Any:
    """Windows (a, n) and (a', n) of one sequence (``h[:, 1:] - h[:, :-1]``): each operand with another
    window than the first's moved by a - a' positions along the global order (rules/halo.py, a halo
    of |a - a'| rows per run) so that its index i sits at the first window's position i + a.
    Returns ({operand: moved local value}, {the first's target}) or why not (a str)."""
    from .halo import shifted_rows

    if len({(t[0], t[1]) for t in targets}) != 1 or any(t[2] is None or t[1] != 1 for t in targets) \
            or len({t[2][1] for t in targets}) != 1:
        return "not windows of equal length along one dim"
    sharded = [a for a in tensors if _sharded(em, a)]
    first = _sharded(em, sharded[0]).window
    converted: Dict[fx.Node, Any] = {}
    for a in sharded:
        s = _sharded(em, a)
        if s.window != first and a not in converted:
            moved = shifted_rows(em, a, s.dim, first[0] - s.window[0])
            if isinstance(moved, str):
                return moved
            converted[a] = moved
    out = next(t for t in targets if t[2] == first)
    return converted, {out}


@chunk_aware
@window_aware
@register_rule(*PER_TOKEN)
def per_token(em: Emitter, node: fx.Node):
    """First argument carries the tokens; the rest are Global weights; trailing dims are features."""
    x, s = node.args[0], _sharded(em, node.args[0])
    others = [a for a in _flat_args(node)[1:] if _sharded(em, a)]
    reduced = _trailing_feature_dims(node)
    if s is None or others or s.dim >= _ndim(x) - reduced:
        return em.fallback(node, f"{_name(node)} over the sequence dim")
    return em.copy(node, *em.value((node.args, node.kwargs))), s


def _trailing_feature_dims(node: fx.Node) -> int:
    """How many trailing dims of the first argument the op reduces over (they must not hold the tokens)."""
    t, nd = node.target, _ndim(node.args[0])
    if t in NORMS:
        shape = arguments(node, ("input", "normalized_shape"))["normalized_shape"]
        return len(shape) if isinstance(shape, (list, tuple)) else 1
    if t in SOFTMAXES:
        dim = arguments(node, ("input", "dim")).get("dim")
        return nd - _norm(-1 if dim is None else dim, nd)
    if t in EMBEDDING:
        return 0
    return 1  # linear: the last dim is contracted


@register_rule(F.local_response_norm)
def local_response_norm(em: Emitter, node: fx.Node):
    """``F.local_response_norm(x (N, C, *), size)`` (AlexNet / GoogLeNet's LRN): each position normalised
    over a window of the channels (dim 1) at that position, so per token unless the tokens are the channels.

        x (B, C, S/N) Sharded(2) -> local_response_norm(x, size) (B, C, S/N) Sharded(2)
    """
    s = _sharded(em, arguments(node, ("input",))["input"])
    if s is None or s.dim == 1 or any(_sharded(em, a) for a in _flat_args(node)[1:]):
        return em.fallback(node, "local_response_norm across the channels that hold the sequence")
    return em.copy(node, *em.value((node.args, node.kwargs))), s


@chunk_aware
@register_rule(operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm")
def matmul(em: Emitter, node: fx.Node):
    """``a @ b`` where exactly one side carries the tokens, along a dim the product keeps.

    Tokens in a's rows: x (B, S, K) @ W (K, N) -> (B, S, N), Sharded(1).
    Tokens in b's columns (RoPE written as ``inv_freq (B, D/2, 1) @ position_ids (B, 1, S)``
    with position_ids an input): (B, D/2, S) Sharded(2). Tokens in a batch dim of both sides
    (``bmm`` of (T, N, K) per-token weights with (T, K, 1) rows): Sharded there. Contracting the
    tokens mixes them.
    """
    a, b = node.args[0], node.args[1]
    sa, sb = _sharded(em, a), _sharded(em, b)
    if sa is not None and sb is None and sa.dim < _ndim(a) - 1 and _ndim(a) >= 2:
        converted = _batch_partner(em, a, sa, b)
        if converted is None:
            return em.fallback(node, "matmul of sequence-sharded rows with a whole operand along another dim")
        args, kwargs = _map(em, node, converted)
        return em.copy(node, args, kwargs), Sharded(sa.dim + _ndim(node) - _ndim(a), sa.inner, chunk=sa.chunk)
    if sb is not None and sa is None and sb.dim == _ndim(b) - 1 and _ndim(b) >= 2 and sb.inner == 1:
        return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(_ndim(node) - 1, chunk=sb.chunk)
    if sa is not None and sb is not None and _same_batch_dim(a, sa, b, sb):
        # tokens in a batch dim of both sides (per-token matrices, e.g. bmm of rows with their expert's
        # weights): one product per token
        return em.copy(node, *em.value((node.args, node.kwargs))), \
            Sharded(sa.dim + _ndim(node) - _ndim(a), sa.inner, chunk=sa.chunk)
    return em.fallback(node, "matmul mixing tokens")


def _batch_partner(em: Emitter, a: fx.Node, sa: Sharded, b: Any) -> Any:
    """The whole operand ``b`` of ``a @ b`` as the local product needs it ({b: new value}, {} if as is),
    or None. When a's tokens are a *batch* dim (a (B, S, H, D) @ b (B, S, D, T), one product per
    token), b's aligned batch dim, if it has the sequence's size, is b's own per-token rows: indexed
    by this rank's positions, as the pointwise rule does (DeepSeek's sparse-attention indexer
    weighting per-token scores). Else b's aligned dim must broadcast (size 1, or absent)."""
    na, nb = _ndim(a), _ndim(b)
    if sa.dim >= na - 2 or not isinstance(b, fx.Node):
        return {}  # tokens in a's rows: b is contracted with a's columns, no token dim of its own
    d = sa.dim - na + nb  # b's dim aligned with a's token dim (batch dims align from the right)
    if d < 0 or d >= nb - 2 or global_shape(b)[d] == 1:
        return {}
    if global_shape(b)[d] != global_shape(a)[sa.dim]:
        return None
    return {b: em.to_sharded(b, d, sa.inner, chunk=sa.chunk)}


def _same_batch_dim(a: fx.Node, sa: Sharded, b: fx.Node, sb: Sharded) -> bool:
    """Both operands sharded along the same batch dim (aligned from the right, not a matrix dim)."""
    na, nb = _ndim(a), _ndim(b)
    return (na >= 3 and nb >= 3 and sa.dim < na - 2 and sb.dim < nb - 2 and sa.dim - na == sb.dim - nb
            and sa.inner == sb.inner and sa.chunk == sb.chunk and global_shape(a)[sa.dim] == global_shape(b)[sb.dim])


@register_rule(torch.addmm, "addmm")
def addmm(em: Emitter, node: fx.Node):
    """``addmm(bias, x, W)`` (HF's GPT-2 ``Conv1D``) on tokens along the rows of x: a per-token linear.

    Before: x (B*S, K) Sharded(0), W (K, N), bias (N,). After: the same call on the
    local rows (B*c, K) -> (B*c, N) Sharded(0). A bias with rows of its own or a
    sharded W mixes tokens and is gathered.
    """
    bias, x, w = node.args[:3]
    s, bias_shape = _sharded(em, x), global_shape(bias) if isinstance(bias, fx.Node) else ()
    bias_rows = len(bias_shape) == 2 and bias_shape[0] != 1
    if s is None or s.dim != 0 or _sharded(em, bias) or _sharded(em, w) or bias_rows:
        return em.fallback(node, "addmm mixing tokens")
    return em.copy(node, *em.value((node.args, node.kwargs))), s
