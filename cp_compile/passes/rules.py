"""The layout rules: one table from op to rule, for ops with a Sharded input.

| op class | ops | Sharded(d) in -> out |
|---|---|---|
| pointwise (broadcasting) | + - * / neg pow square polar, rsqrt/exp/..., silu/gelu/relu, to/float/type_as, masked_fill, where | Sharded(aligned d); Global operands with size S there are indexed by position |
| per-token | linear, embedding, layer_norm, rms_norm (F. and torch.), softmax/log_softmax (not over d) | Sharded(d) |
| matmul | matmul / @ / bmm: tokens in the left side's rows, or in the right side's columns (RoPE as inv_freq @ position_ids), not contracted | Sharded(d) |
| einsum (rules_einsum.py) | any equation keeping the sequence letter in the output; Global operands with it indexed | Sharded(letter's output dim) |
| complex views (rules_complex.py) | view_as_complex / view_as_real (drop / add the trailing (re, im) dim) | Sharded(d) |
| addmm | addmm(bias, x, W) with tokens in x's rows (HF GPT-2 Conv1D) | Sharded(0) |
| views | view/reshape (baked length rewritten to the local one), flatten, (un)squeeze, transpose/permute/movedim, expand, contiguous | Sharded(where d moves) |
| split/join | chunk/split/unbind/cat/stack/repeat_interleave not along d; empty cat operands (HF's training KV cache) dropped | Sharded(d) |
| getitem (rules_getitem.py) | ``...`` expanded; a slice covering all of d (``[:, 0:]``); one position ``x[:, i]`` (cls / last-token pooling) | Sharded(d moved); one position: picked on its rank, all-reduce -> Global |
| size | ``x.size()`` / ``x.size(d)`` (dynamic shapes) | Global: the global sizes, S along d |
| reductions | sum/mean over d | all-reduce -> Global (mean: / global count) |
| attention | scaled_dot_product_attention on Sharded or whole q/k/v (whole: indexed by position) | ring_attention -> Sharded |
| losses | cross_entropy / nll_loss (mean: / global valid count), mse_loss/l1_loss | all-reduce -> Global |
| anything else | per-token by its ATen decomposition (oracle.py: erf, lerp, normalize(-1), ...) | as DTensor propagates |
| what the oracle refuses | (token mixing: slices along d, roll, cumsum, conv, ...) | fallback: gather to Global, warn |
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .context import global_shape
from .layouts import GLOBAL, Sharded, view_layout
from .oracle import decide
from .emitter import Emitter
from .rules_attention import attention_rule, loss_rules
from .rules_complex import complex_rules
from .rules_einsum import einsum_rules
from .rules_getitem import getitem

Rule = Callable[[Emitter, fx.Node], Tuple[Any, Any]]

POINTWISE_FUNCS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.floordiv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.exp,
    torch.log, torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.abs, torch.where, torch.clamp,
    torch.maximum, torch.minimum, torch.masked_fill, F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus,
    F.dropout, torch.square, torch.polar,
}
POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "sin", "cos",
    "abs", "float", "half", "bfloat16", "double", "to", "type_as", "clone", "detach", "masked_fill", "clamp",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__", "square",
}


def _key(node: fx.Node) -> Any:
    return ("method", node.target) if node.op == "call_method" else node.target


def _ndim(node: Any) -> int:
    return len(global_shape(node)) if isinstance(node, fx.Node) and global_shape(node) is not None else 0


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _sharded(em: Emitter, arg: Any) -> Optional[Sharded]:
    lay = em.layout(arg)
    return lay if isinstance(lay, Sharded) else None


def pointwise(em: Emitter, node: fx.Node):
    out_nd = _ndim(node)
    tensors = [a for a in _flat_args(node) if isinstance(a, fx.Node) and global_shape(a) is not None]
    targets = {(s.dim + out_nd - _ndim(a), s.inner) for a in tensors if (s := _sharded(em, a))}
    if len(targets) != 1:
        return em.fallback(node, "sharded operands along different dims")
    out_dim, inner = targets.pop()
    converted: Dict[fx.Node, Any] = {}
    for a in tensors:
        if _sharded(em, a):
            continue
        d = out_dim - (out_nd - _ndim(a))
        if d >= 0 and global_shape(a)[d] != 1:
            converted[a] = em.to_sharded(a, d, inner)  # one entry per position: take this rank's
    args, kwargs = _map(em, node, converted)
    return em.copy(node, args, kwargs), Sharded(out_dim, inner)


def per_token(em: Emitter, node: fx.Node):
    """First argument carries the tokens; the rest are Global weights; trailing dims are features."""
    x, s = node.args[0], _sharded(em, node.args[0])
    others = [a for a in _flat_args(node)[1:] if _sharded(em, a)]
    reduced = _trailing_feature_dims(node)
    if s is None or others or s.dim >= _ndim(x) - reduced:
        return em.fallback(node, f"{_name(node)} over the sequence dim")
    return em.copy(node, *em.value((node.args, node.kwargs))), s


def _trailing_feature_dims(node: fx.Node) -> int:
    t, nd = node.target, _ndim(node.args[0])
    if t in (F.layer_norm, getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)):
        shape = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
        return len(shape) if isinstance(shape, (list, tuple)) else 1
    if t in (F.softmax, F.log_softmax) or (node.op == "call_method" and t in ("softmax", "log_softmax")):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        return nd - _norm(dim, nd)
    if t in (F.embedding,):
        return 0
    return 1  # linear: the last dim is contracted


def matmul(em: Emitter, node: fx.Node):
    """``a @ b`` where exactly one side carries the tokens, along a dim the product keeps.

    Tokens in a's rows: x (B, S, K) @ W (K, N) -> (B, S, N), Sharded(1).
    Tokens in b's columns (RoPE written as ``inv_freq (B, D/2, 1) @ position_ids (B, 1, S)``
    with position_ids an input): (B, D/2, S) Sharded(2). Contracting the tokens mixes them.
    """
    a, b = node.args[0], node.args[1]
    sa, sb = _sharded(em, a), _sharded(em, b)
    if sa is not None and sb is None and sa.dim < _ndim(a) - 1 and _ndim(a) >= 2:
        return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(sa.dim + _ndim(node) - _ndim(a), sa.inner)
    if sb is not None and sa is None and sb.dim == _ndim(b) - 1 and _ndim(b) >= 2 and sb.inner == 1:
        return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(_ndim(node) - 1)
    return em.fallback(node, "matmul mixing tokens")


def addmm(em: Emitter, node: fx.Node):
    """``addmm(bias, x, W)`` (HF's GPT-2 ``Conv1D``) on tokens along the rows of x: a per-token linear.

    Before: x (B*S, K) Sharded(0), W (K, N), bias (N,). After: the same call on the
    local rows (B*c, K) -> (B*c, N) Sharded(0). A bias with rows of its own or a
    sharded W mixes tokens and is gathered.
    """
    bias, x, w = node.args[:3]
    s, bias_shape = _sharded(em, x), global_shape(bias) if isinstance(bias, fx.Node) else ()
    if s is None or s.dim != 0 or _sharded(em, bias) or _sharded(em, w) or (len(bias_shape) == 2 and bias_shape[0] != 1):
        return em.fallback(node, "addmm mixing tokens")
    return em.copy(node, *em.value((node.args, node.kwargs))), s


def view(em: Emitter, node: fx.Node):
    x, s = node.args[0], _sharded(em, node.args[0])
    out = view_layout(global_shape(x), global_shape(node), s, em.ctx.seq_len)
    if out is None:
        return em.fallback(node, "view that splits the sequence dim")
    args = list(em.value(node.args))
    if len(node.args) == 2 and isinstance(node.args[1], fx.Node) and node.args[1].target is torch.Size:
        args[1] = tuple(em.value(node.args[1].args[0]))  # x.view(torch.Size([s0, s1, 192])) (dynamic shapes)
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if sizes:  # a shape baked in for the full sequence: make exactly the sequence dim local
        sizes = list(sizes)
        if sizes[out.dim] != -1:
            sizes[out.dim] = em.index.local_size(sizes[out.dim])
        args = [args[0], tuple(sizes)] if len(node.args) == 2 and isinstance(args[1], (list, tuple)) \
            else [args[0], *sizes]
    kwargs = dict(em.value(node.kwargs))
    if "shape" in kwargs and kwargs["shape"][out.dim] != -1:
        kwargs["shape"] = tuple(em.index.local_size(v) if i == out.dim else v for i, v in enumerate(kwargs["shape"]))
    return em.copy(node, tuple(args), kwargs), out


def shape_only(em: Emitter, node: fx.Node):
    """Ops without size arguments (flatten, squeeze, unsqueeze, contiguous): follow the shapes."""
    s = _sharded(em, node.args[0])
    out = view_layout(global_shape(node.args[0]), global_shape(node), s, em.ctx.seq_len)
    if out is None:
        return em.fallback(node, f"{_name(node)} that splits the sequence dim")
    return em.copy(node, *em.value((node.args, node.kwargs))), out


def permute(em: Emitter, node: fx.Node):
    s, nd = _sharded(em, node.args[0]), _ndim(node.args[0])
    name = _name(node)
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (_norm(d, nd) for d in _dims_args(node, 2))
        order = list(range(nd))
        order[d0], order[d1] = order[d1], order[d0]
    elif name == "t":
        order = list(reversed(range(nd)))
    elif name == "permute":
        order = [_norm(d, nd) for d in _dims_args(node, nd)]
    else:  # movedim
        src, dst = (_norm(d, nd) for d in _dims_args(node, 2))
        order = [d for d in range(nd) if d != src]
        order.insert(dst, src)
    return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(order.index(s.dim), s.inner)


def expand(em: Emitter, node: fx.Node):
    s, x = _sharded(em, node.args[0]), node.args[0]
    out_dim = s.dim + _ndim(node) - _ndim(x)
    args = em.value(node.args)
    sizes = list(args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    if sizes[out_dim] != -1:
        sizes[out_dim] = em.index.local_size(sizes[out_dim])
    return em.copy(node, (em.env[x], *sizes), {}), Sharded(out_dim, s.inner)


def along_dim(em: Emitter, node: fx.Node):
    """chunk / split / unbind / repeat_interleave: fine unless along the sequence dim."""
    x, s = node.args[0], _sharded(em, node.args[0])
    nd, name = _ndim(x), _name(node)
    default = 0 if name in ("chunk", "split", "unbind") else None
    pos = {"chunk": 2, "split": 2, "unbind": 1, "repeat_interleave": 2}.get(name, 2)
    dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
    if dim is None or _norm(dim, nd) == s.dim:
        return em.fallback(node, f"{name} along the sequence dim")
    new = em.copy(node, *em.value((node.args, node.kwargs)))
    if name == "repeat_interleave":
        return new, s
    n_out = len(node.meta["example_value"])
    out = Sharded(s.dim - (1 if name == "unbind" and _norm(dim, nd) < s.dim else 0), s.inner)
    return new, tuple(out for _ in range(n_out))


def concat(em: Emitter, node: fx.Node):
    """cat / stack of operands that share one sequence layout, not along the sequence dim.

    Empty operands are dropped first: Hugging Face's KV cache in training is
    ``torch.cat([torch.tensor([]), k], dim=-2)`` (a 1-D empty tensor, which cat skips),
    so ``cat([empty (0,), k (B, H, S, D)], -2) -> k`` stays Sharded.
    """
    tensors = [t for t in node.args[0] if not _is_empty(t)] if node.target is not torch.stack else list(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if len(tensors) == 1 and _sharded(em, tensors[0]):  # cat promotes dtypes over the empties too
        out, dtype = em.env[tensors[0]], node.meta["example_value"].dtype
        same = tensors[0].meta["example_value"].dtype == dtype
        return (out if same else em.method("to", out, dtype)), _sharded(em, tensors[0])
    lays = {(s.dim, s.inner) for t in tensors if (s := _sharded(em, t))}
    nd = _ndim(tensors[0])
    seq_dim, inner = lays.pop() if len(lays) == 1 else (None, 1)
    is_stack = node.target is torch.stack
    if seq_dim is None or (not is_stack and _norm(dim, nd) == seq_dim):
        return em.fallback(node, f"{_name(node)} along the sequence dim")
    conv = {t: em.to_sharded(t, seq_dim, inner) for t in tensors if not _sharded(em, t)}
    new_list = [conv.get(t, em.env[t]) for t in tensors]
    out_dim = seq_dim + (1 if is_stack and _norm(dim, nd + 1) <= seq_dim else 0)
    return em.copy(node, (new_list, *em.value(node.args[1:])), em.value(node.kwargs)), Sharded(out_dim, inner)


def _is_empty(t: Any) -> bool:
    """A tensor operand with no elements (cat skips 1-D empties and adds nothing for others)."""
    shape = global_shape(t) if isinstance(t, fx.Node) else None
    return shape is not None and 0 in shape


def reduction(em: Emitter, node: fx.Node):
    x, s, nd, name = node.args[0], _sharded(em, node.args[0]), _ndim(node.args[0]), _name(node)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = list(range(nd)) if dim is None else [_norm(d, nd) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    if s.dim not in dims:
        shift = 0 if keep else sum(1 for d in dims if d < s.dim)
        return em.copy(node, *em.value((node.args, node.kwargs))), Sharded(s.dim - shift, s.inner)
    if name not in ("sum", "mean") or len(node.args) > 3 or set(node.kwargs) - {"dim", "keepdim"}:
        return em.fallback(node, f"{name} over the sequence dim")
    mask = em.valid_mask(x, em.env[x], s.dim, s.inner)
    local = em.env[x] if mask is None else em.call(torch.where, mask, em.env[x], 0.0)  # padding adds nothing
    total = em.method("sum", local, dims, keep)
    if name == "mean":  # / global count: the other reduced dims' sizes times S
        count = em.index.S()
        for d in dims:
            if d != s.dim:
                count = em.index.op(operator.mul, count, em.method("size", em.env[x], d))
        total = em.call(operator.truediv, total, count)
    from .. import graph_ops

    return em.call(graph_ops.all_reduce_sum, total, em.ctx.group.name), GLOBAL


def _flat_args(node: fx.Node) -> list:
    from torch.utils._pytree import tree_flatten

    return tree_flatten((node.args, node.kwargs))[0]


def _map(em: Emitter, node: fx.Node, converted: Dict[fx.Node, Any]):
    return fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: converted.get(a, em.env[a]) if isinstance(a, fx.Node) else a
    )


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def size(em: Emitter, node: fx.Node):
    """``x.size()`` / ``x.size(d)`` of a Sharded x: the *global* sizes (Dynamo emits them under
    dynamic shapes, e.g. ``y.reshape(x.size())``), the sequence dim as S. Global: a tuple of
    ints and graph values, which the view rule makes local again where it is a length."""
    x, s = node.args[0], _sharded(em, node.args[0])
    shape, idx = global_shape(x), em.index

    def one(d: int) -> Any:
        if em.ctx.seq_sym is None:
            return shape[d]
        local = em.method("size", em.env[x], d)
        return idx.op(operator.mul, idx.op(operator.floordiv, local, idx.c()), idx.S()) if d == s.dim else local

    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return (one(dim % len(shape)) if dim is not None else tuple(one(d) for d in range(len(shape)))), GLOBAL


def _dims_args(node: fx.Node, n: int) -> Sequence[int]:
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return rest[0]
    if rest:
        return rest
    return [node.kwargs[k] for k in ("dim0", "dim1", "source", "destination", "dims") if k in node.kwargs][:n]


def _table() -> Dict[Any, Rule]:
    t: Dict[Any, Rule] = {f: pointwise for f in POINTWISE_FUNCS}
    t.update({("method", m): pointwise for m in POINTWISE_METHODS})
    norms = [getattr(m, "rms_norm") for m in (F, torch) if hasattr(m, "rms_norm")]  # nn.RMSNorm: torch.rms_norm
    for f in (F.linear, torch._C._nn.linear, F.embedding, F.layer_norm, F.softmax, F.log_softmax, *norms):
        t[f] = per_token
    t.update({("method", "softmax"): per_token, ("method", "log_softmax"): per_token})
    t.update({operator.matmul: matmul, torch.matmul: matmul, torch.bmm: matmul,
              ("method", "matmul"): matmul, ("method", "bmm"): matmul})
    t.update({torch.addmm: addmm, ("method", "addmm"): addmm})
    t.update({("method", "view"): view, ("method", "reshape"): view, torch.reshape: view})
    for m in ("flatten", "squeeze", "unsqueeze", "contiguous"):
        t[("method", m)] = shape_only
    t.update({torch.flatten: shape_only, torch.squeeze: shape_only, torch.unsqueeze: shape_only})
    for m in ("transpose", "swapaxes", "swapdims", "permute", "movedim", "t"):
        t[("method", m)] = permute
    t.update({torch.transpose: permute, torch.permute: permute, torch.movedim: permute})
    t[("method", "expand")] = expand
    for m in ("chunk", "split", "unbind", "repeat_interleave"):
        t[("method", m)] = along_dim
    t.update({torch.chunk: along_dim, torch.split: along_dim, torch.unbind: along_dim})
    t.update({torch.cat: concat, torch.concat: concat, torch.stack: concat})
    t[operator.getitem] = getitem
    t[("method", "size")] = size
    for m in ("sum", "mean"):
        t[("method", m)] = reduction
    t.update({torch.sum: reduction, torch.mean: reduction})
    t.update(attention_rule())
    t.update(loss_rules())
    t.update(complex_rules())
    t.update(einsum_rules())
    return t


RULES: Dict[Any, Rule] = _table()


def apply_rule(em: Emitter, node: fx.Node):
    """Layout and new value of ``node``, which has at least one Sharded input."""
    rule = RULES.get(_key(node))
    if rule is None:
        decided = decide(em, node)  # no hand rule: ask the op's ATen decomposition before gathering
        if decided is not None:
            return decided
        return em.fallback(node, f"{_name(node)} is not known to be per-token")
    return rule(em, node)
