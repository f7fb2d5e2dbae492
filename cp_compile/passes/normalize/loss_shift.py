"""A loss on a slice of the sequence becomes the same loss on the whole sequence, its targets
padded with ``ignore_index`` (class losses) or masked out (elementwise losses) where the slice
dropped positions.

Before (a label shift inside the model: nanoGPT-style code, ``examples/models.py`` with
``shift_labels_inside``; any ``[:, a:S-b]`` with step 1):

    logits (B, S, V) ─ [:, a:S-b] ─ contiguous / casts ─ reshape(-1, V) ───────────────┐
    y (B, S-a-b): any target of the sliced length (labels[:, 1:]) ─ reshape(-1) ─ cross_entropy

After (the same function on one device, a program identity):

    logits (B, S, V) ─ contiguous / casts ─ reshape(-1, V) ───────────────────────────────────┐
    y ─ reshape(-1) ─ reshape(outer, S-a-b, inner) ─ pad((a, b), ignore_index) ─ reshape(-1) ─ cross_entropy

``mse_loss`` / ``l1_loss`` (next-frame prediction, ``mse(pred[:, :-1], x[:, 1:])``): the other
operand is padded with zeros, the per-element terms are kept only at the positions the
slice kept (``where(valid, mse(.., reduction="none"), 0).sum()``), and a mean divides by the
sliced element count.

A target equal to ``ignore_index`` adds nothing to the sum and nothing to the count of a
mean (with class weights and label smoothing too), so the loss is unchanged. The slice of
the logits, which is a slice of the sharded sequence and would be all-gathered
(``(B, S, V)`` floats), is gone; what moved are the targets, integers every rank holds
whole (a ``labels`` input, or ``idx`` itself read whole: :func:`.rules.getitem.getitem`),
and the loss rule indexes them at this rank's positions. Applied only where the sliced dim
has the attention's length S and the path from the slice to the loss keeps rows apart
(casts, ``contiguous``, views that keep the sequence factor whole, softmaxes over other
dims, scalar arithmetic); ``reduction="none"`` and strided slices keep the slice (gathered,
warned).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..context import RewriteContext, fake_value, global_shape, log, source_line
from ..op_vocab import (CLASS_LOSSES, ELEMENTWISE_LOSSES, FLATTENS, LOG_SOFTMAX, RESHAPES, ROW_KEEPING,
                        SCALAR_ARITHMETIC, SOFTMAX, arguments)
from ..propagate.emitter import erase_unused
from .fake_emit import FakeEmitter
from ..propagate.placements import Sharded, view_placement

_SOFTMAX = SOFTMAX | LOG_SOFTMAX


def move_loss_slices(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Rewrite every class loss read through a sequence slice (module docstring); the count."""
    count = sum(_move(gm, node, ctx) for node in list(gm.graph.nodes)
                if node.op == "call_function" and node.target in CLASS_LOSSES + ELEMENTWISE_LOSSES)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _movable(loss: fx.Node) -> Optional[Dict[str, Any]]:
    """The loss's arguments by name when its reduction can move (mean or sum, no legacy arguments), else None."""
    a = arguments(loss)
    if "reduction" not in a:
        return None  # arguments the loss does not take: Python would raise
    ok = a.get("size_average") is None and a.get("reduce") is None and a["reduction"] in ("mean", "sum")
    if loss.target in ELEMENTWISE_LOSSES:  # both operands tensors of one shape, no weights
        ok = ok and a.get("weight") is None and all(isinstance(a[k], fx.Node) for k in ("input", "target"))
        return a if ok and global_shape(a["input"]) == global_shape(a["target"]) else None
    return a if ok and type(a["ignore_index"]) is int and isinstance(a["target"], fx.Node) else None


def _seq_slice(node: fx.Node, ctx: RewriteContext) -> Optional[Tuple[int, int, int]]:
    """(dim, a, b) when ``node`` is ``x[..., a:S-b, ...]``: one step-1 slice of a dim of size S."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    shape, index = global_shape(node.args[0]), node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if shape is None or any(i is None or isinstance(i, (int, fx.Node)) for i in index) or index.count(Ellipsis) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    cut = [(d, i) for d, i in enumerate(index) if i != slice(None)]
    if len(cut) != 1 or shape[cut[0][0]] != ctx.seq_len or not isinstance(cut[0][1], slice):
        return None
    d, sl = cut[0]
    if not all(v is None or type(v) is int for v in (sl.start, sl.stop, sl.step)) or sl.step not in (None, 1):
        return None
    if ctx.seq_sym is not None and ((sl.start or 0) < 0 or (sl.stop is not None and sl.stop >= 0)):
        return None  # under a symbolic S only bounds relative to the ends mean the same at every length
    r = range(ctx.seq_len)[sl]
    return (d, r.start, ctx.seq_len - r.stop) if len(r) else None


def _softmax_dim(node: fx.Node) -> Optional[int]:
    """The dim a softmax normalises over, when it is a constant."""
    dim = arguments(node, ("input", "dim")).get("dim")
    return dim if type(dim) is int else None


def _step(node: fx.Node, seq: Sharded, length: int) -> Optional[Tuple[Sharded, tuple]]:
    """Where the sequence factor lands after the row-keeping op ``node`` (its input's at ``seq``),
    and the op's new arguments on the whole sequence; None for any other op."""
    key = node.target
    rest = node.args[1:]
    if node.op in ("call_method", "call_function") and key in ROW_KEEPING:
        return seq, rest
    if node.op == "call_function" and key in SCALAR_ARITHMETIC:
        ok = len(node.args) == 2 and isinstance(node.args[1], (int, float)) and not node.kwargs
        return (seq, rest) if ok else None
    if key in _SOFTMAX:
        dim = _softmax_dim(node)
        nd = len(global_shape(node))
        return (seq, rest) if dim is not None and dim % nd != seq.dim and seq.inner == 1 else None
    if key in ("transpose", "permute", torch.transpose, torch.permute):
        moved = _permuted(node, seq)
        return (moved, rest) if moved is not None else None
    if key in RESHAPES or key in FLATTENS:
        new = view_placement(global_shape(node.args[0]), global_shape(node), seq, length)
        if new is None or key in FLATTENS:
            return (new, rest) if new is not None else None
        shape = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else list(rest)
        if len(shape) != len(global_shape(node)) or any(s == -1 for k, s in enumerate(shape) if k != new.dim):
            return None
        shape[new.dim] = -1  # the one dim holding the sequence factor: its size follows the input's
        return new, tuple(shape)
    return None


def _permuted(node: fx.Node, seq: Sharded) -> Optional[Sharded]:
    """The sequence dim after ``transpose(i, j)`` / ``permute(dims)`` (its inner factor unchanged)."""
    nd, args = len(global_shape(node)), node.args[1:]
    dims = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else list(args)
    if not all(type(d) is int for d in dims) or node.kwargs:
        return None
    dims = [d % nd for d in dims]
    if node.target in ("transpose", torch.transpose):
        i, j = dims
        return Sharded(j if seq.dim == i else i if seq.dim == j else seq.dim, seq.inner)
    return Sharded(dims.index(seq.dim), seq.inner)


def _row_chain(start: fx.Node, ctx: RewriteContext) -> Optional[Tuple[fx.Node, Tuple[int, int, int], List[fx.Node]]]:
    """From a loss input up to a sequence slice through single-use row-keeping ops:
    (the slice, (dim, a, b), the ops between them, nearest the slice first)."""
    chain, cur = [], start
    while isinstance(cur, fx.Node) and len(cur.users) == 1:
        cut = _seq_slice(cur, ctx)
        if cut is not None:
            return cur, cut, chain[::-1]
        if cur.op not in ("call_function", "call_method") or not cur.args or not isinstance(cur.args[0], fx.Node):
            return None
        chain.append(cur)
        cur = cur.args[0]
    return None


@dataclass
class _Unsliced:
    """A loss operand read through a sequence slice, rebuilt on the whole sequence."""

    fe: FakeEmitter  # emits before the loss, with its source line
    new: fx.Node  # the operand's ops applied to the unsliced value
    seq: Sharded  # where the sequence factor lands in the operand
    whole: fx.Node  # the value the slice was taken of
    dim: int  # its sliced dim
    ab: Tuple[int, int]  # positions dropped at the start and at the end


def _unslice(gm: fx.GraphModule, loss: fx.Node, operand: fx.Node, ctx: RewriteContext,
             class_dim: bool) -> Optional[_Unsliced]:
    found = _row_chain(operand, ctx)
    if found is None:
        return None
    sl, (dim, a, b), chain = found
    seq, length, steps = Sharded(dim), ctx.seq_len - a - b, []
    for node in chain:
        step = _step(node, seq, length)
        if step is None:
            return None
        seq = step[0]
        steps.append(step[1])
    if class_dim and len(global_shape(operand)) > 1 and seq.dim == 1:
        return None  # the sequence in the class dim: not a per-token loss
    fe = FakeEmitter(gm.graph, loss, sl)
    new = sl.args[0]
    for node, args in zip(chain, steps):
        emit = fe.fn if node.op == "call_function" else fe.method
        new = emit(node.target, new, *args, **node.kwargs)
    return _Unsliced(fe, new, seq, sl.args[0], dim, (a, b))


def _move(gm: fx.GraphModule, loss: fx.Node, ctx: RewriteContext) -> int:
    args = _movable(loss)
    if args is None:
        return 0
    elementwise = loss.target in ELEMENTWISE_LOSSES
    for name, other in (("input", "target"), ("target", "input"))[: 2 if elementwise else 1]:
        un = _unslice(gm, loss, args[name], ctx, class_dim=not elementwise)
        if un is not None:
            break
    else:
        return 0
    old = args[name]
    if elementwise:
        _masked_elementwise(gm, loss, un, args[other], args["reduction"])
    else:
        td = 0 if un.seq.dim == 0 else un.seq.dim - 1  # input (N, C, d1..) pairs with target (N, d1..)
        loss.replace_input_with(old, un.new)
        loss.replace_input_with(args[other], _pad(un, args[other], td, args["ignore_index"]))
    erase_unused(gm.graph, [old])
    log.info("cp_compile: the loss at %s reads the sequence sliced [%d:S-%d]: computed on the whole sequence, "
             "the other operand padded (no gather)", source_line(loss), *un.ab)
    return 1


def _masked_elementwise(gm: fx.GraphModule, loss: fx.Node, un: _Unsliced, other: fx.Node, reduction: str) -> None:
    """mse_loss / l1_loss: per-element terms on the whole sequence, zero at the dropped positions;
    a mean divides by the sliced operand's element count (the loss node is replaced)."""
    fe = un.fe
    padded = _pad(un, other, un.seq.dim, 0)
    valid = _pad(un, fe.fn(torch.ones_like, other, dtype=torch.bool), un.seq.dim, False)
    terms = fe.fn(torch.where, valid, fe.fn(loss.target, un.new, padded, reduction="none"), 0.0)
    total = fe.method("sum", terms)
    if reduction == "mean":
        n = fake_value(other).numel()
        total = fe.fn(operator.truediv, total, n if isinstance(n, int) else fe.method("numel", other))
    loss.replace_all_uses_with(total)
    gm.graph.erase_node(loss)


def _pad(un: _Unsliced, tgt: fx.Node, td: int, value: Any) -> fx.Node:
    """``tgt`` (the sliced length S' = S-a-b in its sequence factor at dim ``td``) placed at positions
    a..S-b-1 of the whole sequence, ``value`` elsewhere: the same shape with S in place of S'."""
    fe, nd = un.fe, fake_value(tgt).dim()
    s_new = fe.size(un.whole, un.dim)
    s_cut = s_new - sum(un.ab) if isinstance(s_new, int) else fe.fn(operator.sub, s_new, sum(un.ab))
    pre = [fe.size(tgt, i) for i in range(td)]
    post = [fe.size(tgt, i) for i in range(td + 1, nd)]
    split = fe.method("reshape", tgt, *pre, -1, s_cut, un.seq.inner, *post)  # (..., outer, S', inner, ...)
    pad = (0, 0) * (1 + len(post)) + tuple(un.ab)
    whole = fe.fn(F.pad, split, pad, value=value)  # (..., outer, S, inner, ...)
    return fe.method("reshape", whole, *pre, -1, *post)
