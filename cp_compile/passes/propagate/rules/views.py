"""Layout rules for views, permutes and split/join ops (docs/design.md §6).

    x (B, S/N, H*Dh).view(B, S, H, Dh)   -> view(B, c, H, Dh): the baked length becomes the local one
    x (B, S/N, D).transpose(1, 2)        -> Sharded(2)
    cat([a, b], dim=-1) of Sharded(1)    -> Sharded(1)   (not along the sequence dim)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...context import global_shape
from ...op_vocab import FLATTENS, JOINS, PERMUTES, RESHAPES, SPLITS, SQUEEZES, arguments
from ..emitter import Emitter
from ..placements import Sharded, view_placement
from .common import _name, _ndim, _norm, _sharded
from .registry import chunk_aware, register_rule, window_aware


def _placement(em: Emitter, node: fx.Node, s: Sharded):
    """Where ``node`` (a view of its first argument, Sharded ``s``) holds the tokens, or None. A window
    (a slice of the sequence, n long) must stay a dim of its own: n rows, none merged with other dims."""
    x = node.args[0]
    if s.window is None:
        return view_placement(global_shape(x), global_shape(node), s, em.ctx.seq_len)
    n = s.window[1]
    out = view_placement(global_shape(x), global_shape(node), s, n)
    if out is None or out.inner != 1 or out.chunk != 1 or global_shape(node)[out.dim] != n:
        return None
    return s.moved(out.dim)


def _moved(em: Emitter, node: fx.Node, s: Sharded, what: str) -> Any:
    """Where ``node`` holds the tokens, or why not (a str): a view into chunks of C tokens needs each
    rank's runs to be whole chunks of the single-device grid (SeqIndex.chunk_refusal)."""
    out = _placement(em, node, s)
    if out is None:
        return what
    if out.chunk > s.chunk:
        why = em.index.chunk_refusal(out.chunk)
        if why is not None:
            return f"{what} into chunks of {out.chunk} tokens: {why}"
    return out


def _local_len(em: Emitter, size, out: Sharded):
    """A size baked into a view along the tokens' dim ``out``, made this rank's."""
    if out.window is not None:  # windows: static S, the dim is the n rows alone (:func:`_placement`)
        return em.ctx.padded_len // em.ctx.world
    return em.index.local_size(size, out.chunk)


@chunk_aware
@window_aware
@register_rule(*RESHAPES)
def view(em: Emitter, node: fx.Node):
    """view / reshape: the sequence dim where it lands; a length baked in for the full sequence made local."""
    s = _sharded(em, node.args[0])
    out = _moved(em, node, s, "view that splits the sequence dim (or merges a slice of it with other dims)")
    if isinstance(out, str):
        return em.fallback(node, out)
    args = list(em.value(node.args))
    if len(node.args) == 2 and isinstance(node.args[1], fx.Node) and node.args[1].target is torch.Size:
        args[1] = tuple(em.value(node.args[1].args[0]))  # x.view(torch.Size([s0, s1, 192])) (dynamic shapes)
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if sizes:  # a shape baked in for the full sequence: make exactly the sequence dim local
        sizes = list(sizes)
        if sizes[out.dim] != -1:
            sizes[out.dim] = _local_len(em, sizes[out.dim], out)
        args = [args[0], tuple(sizes)] if len(node.args) == 2 and isinstance(args[1], (list, tuple)) \
            else [args[0], *sizes]
    kwargs = dict(em.value(node.kwargs))
    if "shape" in kwargs and kwargs["shape"][out.dim] != -1:
        kwargs["shape"] = tuple(_local_len(em, v, out) if i == out.dim else v for i, v in enumerate(kwargs["shape"]))
    return em.copy(node, tuple(args), kwargs), out


@chunk_aware
@window_aware
@register_rule(*FLATTENS, *SQUEEZES, "contiguous")
def shape_only(em: Emitter, node: fx.Node):
    """Ops without size arguments (flatten, squeeze, unsqueeze, contiguous): follow the shapes."""
    s = _sharded(em, node.args[0])
    out = _moved(em, node, s, f"{_name(node)} that splits the sequence dim")
    if isinstance(out, str):
        return em.fallback(node, out)
    return em.copy(node, *em.value((node.args, node.kwargs))), out


@chunk_aware
@window_aware
@register_rule(*PERMUTES)
def permute(em: Emitter, node: fx.Node):
    """transpose / swapaxes / swapdims / t / permute / movedim: the sequence dim follows the permutation."""
    s, nd = _sharded(em, node.args[0]), _ndim(node.args[0])
    name, a = _name(node), arguments(node)
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (_norm(a[k], nd) for k in a if k != "input")
        order = list(range(nd))
        order[d0], order[d1] = order[d1], order[d0]
    elif name == "t":
        order = list(reversed(range(nd)))
    elif name == "permute":
        order = [_norm(d, nd) for d in a["dims"]]
    else:  # movedim
        src, dst = _norm(a["source"], nd), _norm(a["destination"], nd)
        order = [d for d in range(nd) if d != src]
        order.insert(dst, src)
    return em.copy(node, *em.value((node.args, node.kwargs))), s.moved(order.index(s.dim))


@chunk_aware
@register_rule("expand")
def expand(em: Emitter, node: fx.Node):
    """``x.expand(sizes)``: the sequence dim's size made the local length."""
    s, x = _sharded(em, node.args[0]), node.args[0]
    out_dim = s.dim + _ndim(node) - _ndim(x)
    args = em.value(node.args)
    sizes = list(args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    if sizes[out_dim] != -1:
        sizes[out_dim] = em.index.local_size(sizes[out_dim], s.chunk)
    return em.copy(node, (em.env[x], *sizes), {}), Sharded(out_dim, s.inner, chunk=s.chunk)


@chunk_aware
@register_rule(*SPLITS)
def along_dim(em: Emitter, node: fx.Node):
    """chunk / split / unbind / repeat_interleave: fine unless along the sequence dim (or its chunks)."""
    x, s = node.args[0], _sharded(em, node.args[0])
    nd, name = _ndim(x), _name(node)
    second = {"unbind": "dim", "repeat_interleave": "repeats"}.get(name, "sections")  # by position if unnamed
    a = arguments(node, ("input", second, "dim"))
    dim, repeats = a.get("dim", 0 if name in ("chunk", "split", "unbind") else None), a.get("repeats")
    if name == "repeat_interleave" and dim is not None and _norm(dim, nd) == s.dim and type(repeats) is int \
            and s.chunk == 1:
        # each token row repeated r times in place: row t·r + j, i.e. the token dim with inner·r
        return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(s.dim, s.inner * repeats)
    if dim is None or _norm(dim, nd) == s.dim:
        return em.fallback(node, f"{name} along the sequence dim")
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    if name == "repeat_interleave":
        return new, s
    n_out = len(node.meta["example_value"])
    out = Sharded(s.dim - (1 if name == "unbind" and _norm(dim, nd) < s.dim else 0), s.inner, chunk=s.chunk)
    return new, tuple(out for _ in range(n_out))


@chunk_aware
@register_rule(*JOINS)
def concat(em: Emitter, node: fx.Node):
    """cat / stack of operands that share one sequence layout, not along the sequence dim.

    Empty operands are dropped first: Hugging Face's KV cache in training is
    ``torch.cat([torch.tensor([]), k], dim=-2)`` (a 1-D empty tensor, which cat skips),
    so ``cat([empty (0,), k (B, H, S, D)], -2) -> k`` stays Sharded.
    """
    tensors = [t for t in node.args[0] if not _is_empty(t)] if node.target is not torch.stack else list(node.args[0])
    dim = arguments(node, ("tensors", "dim")).get("dim", 0)
    if len(tensors) == 1 and _sharded(em, tensors[0]):  # cat promotes dtypes over the empties too
        out, dtype = em.env[tensors[0]], node.meta["example_value"].dtype
        same = tensors[0].meta["example_value"].dtype == dtype
        return (out if same else em.method("to", out, dtype)), _sharded(em, tensors[0])
    lays = {(s.dim, s.inner, s.chunk) for t in tensors if (s := _sharded(em, t))}
    nd = _ndim(tensors[0])
    seq_dim, inner, chunk = lays.pop() if len(lays) == 1 else (None, 1, 1)
    is_stack = node.target is torch.stack
    if not is_stack and seq_dim is not None and _norm(dim, nd) == seq_dim and chunk == 1 \
            and _flattened_tokens(em, tensors, seq_dim):
        # rows of flattened tokens (B·S, ...) stacked: locally (outer_1 + outer_2 + ...)·c rows, outer-major
        return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(seq_dim, inner)
    if seq_dim is None or (not is_stack and _norm(dim, nd) == seq_dim):
        return em.fallback(node, f"{_name(node)} along the sequence dim")
    conv = {t: em.to_sharded(t, seq_dim, inner, chunk=chunk) for t in tensors if not _sharded(em, t)}
    new_list = [conv.get(t, em.env[t]) for t in tensors]
    out_dim = seq_dim + (1 if is_stack and _norm(dim, nd + 1) <= seq_dim else 0)
    out = Sharded(out_dim, inner, chunk=chunk)
    return em.copy(node, (new_list, *em.value(node.args[1:])), em.value(node.kwargs)), out


def _flattened_tokens(em: Emitter, tensors: list, dim: int) -> bool:
    """Every operand Sharded along ``dim`` with the tokens merged below outer dims (size outer·S·inner,
    outer > 1: the rows of ``x.view(-1, D)``): a cat along ``dim`` then only stacks more outer blocks."""
    lays = [_sharded(em, t) for t in tensors]
    if not all(lays):
        return False
    S = em.ctx.seq_len
    return all(global_shape(t)[dim] > S * s.inner for t, s in zip(tensors, lays))


def _is_empty(t: Any) -> bool:
    """A tensor operand with no elements (cat skips 1-D empties and adds nothing for others)."""
    shape = global_shape(t) if isinstance(t, fx.Node) else None
    return shape is not None and 0 in shape
