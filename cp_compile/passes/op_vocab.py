"""The op vocabulary every pass shares: which FX targets are products, softmaxes, casts, views,
pointwise and per-token ops, attention, losses and masks; and how to read a node's arguments
(:func:`arguments`, by parameter name with defaults) and fake value.

Dynamo's graph names one op several ways (``operator.matmul``, ``torch.matmul``, the method
``"matmul"``, ``"__matmul__"``); each set below holds every spelling (a str is a method name),
so a pass asks ``is_(node, MATMUL)`` and never lists them again. The layout rules key their
table by :func:`rule_key` (a method name becomes ``("method", name)``).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Dict, Iterable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

from .fx_utils import IN_PLACE_OPERATORS, fake_value, writes_in_place  # noqa: F401 (re-exported: part of the vocabulary)
from .analyze.score_fn import scaled_dot_product_attention_with_scores

# attention the ring replaces: SDPA, and SDPA with a function of the scores (score_fn.py: soft-capping)
SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                scaled_dot_product_attention_with_scores}
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # in order
MATMUL = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm", "__matmul__"}
EINSUM = {torch.einsum, torch.functional.einsum}
BADDBMM = {torch.baddbmm, "baddbmm"}
SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax, "softmax", torch.special.softmax}
LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, "log_softmax"}
CASTS = {"to", "type_as", "float", "half", "bfloat16", "double", "type", "contiguous", "clone"}
MUL = {operator.mul, torch.mul, "mul", operator.imul}
DIV = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide", operator.itruediv}
ADD = {operator.add, torch.add, "add", operator.iadd}
SUB = {operator.sub, torch.sub, "sub", operator.isub}
MASKED_FILL = {torch.masked_fill, "masked_fill"}
WHERE = {torch.where, "where"}
DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout}

# ops computed per element of their broadcast operands (the layout rules' pointwise class)
POINTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.floordiv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.exp,
    torch.log, torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.abs, torch.where, torch.clamp,
    torch.maximum, torch.minimum, torch.masked_fill, F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus,
    F.dropout, torch.square, torch.polar,
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "sin", "cos",
    "abs", "float", "half", "bfloat16", "double", "to", "type_as", "clone", "detach", "masked_fill", "clamp",
    "__add__", "__mul__", "__sub__", "__truediv__", "__radd__", "__rmul__", "square",
}
# per-token ops: the tokens in the first argument, features in its trailing dims, Global weights
LINEAR = {F.linear, torch._C._nn.linear}
NORMS = {F.layer_norm, *(getattr(m, "rms_norm") for m in (F, torch) if hasattr(m, "rms_norm"))}  # nn.RMSNorm
SOFTMAXES = {F.softmax, F.log_softmax, "softmax", "log_softmax"}  # over the dim given (not the tokens)
EMBEDDING = {F.embedding}
PER_TOKEN = LINEAR | NORMS | SOFTMAXES | EMBEDDING
# reshapes in row-major order, and the ops that only follow the shapes (no size arguments)
RESHAPES = {"view", "reshape", torch.reshape}
FLATTENS = {"flatten", torch.flatten}
SQUEEZES = {"squeeze", "unsqueeze", torch.squeeze, torch.unsqueeze}
VIEWS = RESHAPES | FLATTENS | {"unflatten", torch.unflatten}  # row-major regroupings (the attention matcher's)
PERMUTES = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "t", torch.transpose, torch.permute,
            torch.movedim}
VALUE_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "contiguous", "clone"}  # methods: same values
SHAPE_VIEWS = RESHAPES | FLATTENS | SQUEEZES | {"contiguous", "expand", "expand_as"}  # keep the values' order
SPLITS = {"chunk", "split", "unbind", "repeat_interleave", torch.chunk, torch.split, torch.unbind}
JOINS = {torch.cat, torch.concat, torch.concatenate, torch.stack}
CATS = {torch.cat, torch.concat, torch.concatenate}
# data-dependent selections of rows (MoE routing), and the writes back by their indices
SELECTIONS = {torch.nonzero, torch.argwhere, "nonzero", "argwhere"}
SORTS = {torch.sort, "sort", torch.argsort, "argsort"}
INDEX_ADDS = {"index_add_", "index_add", torch.index_add, "index_copy_", "index_copy", torch.index_copy}
INDEX_PUTS = {"index_put_", "index_put", torch.index_put, torch.index_put_}
SCATTERS = {"scatter_add_", "scatter_add", torch.scatter_add, "scatter_", "scatter", torch.scatter, "scatter_reduce_",
            "scatter_reduce", torch.scatter_reduce}
# losses: a class index per token (cross entropy), or a term per element
CLASS_LOSSES = (F.cross_entropy, F.nll_loss)
ELEMENTWISE_LOSSES = (F.mse_loss, F.l1_loss)
MASK_KEEPING = {"expand", "to", "contiguous", "bool"}  # methods that keep a boolean mask's meaning (dims right-aligned)
IDS_KEEPING = {"to", "contiguous", "long", "int"}  # methods that keep integer ids' values
EQ = {operator.eq, torch.eq, "eq"}
# ops that keep each row of a loss's input a function of that row alone, and arithmetic with a scalar
ROW_KEEPING = {"contiguous", "float", "double", "half", "bfloat16", "to", "type", "type_as", "clone", "detach", "tanh",
               "neg", torch.tanh, torch.neg, operator.neg}
SCALAR_ARITHMETIC = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div}
# ops whose output row i depends only on row i of each (broadcast) operand, for boolean masks too
MASK_ELEMENTWISE = {
    operator.and_, operator.or_, operator.xor, operator.invert, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.logical_and, torch.logical_or, torch.logical_not, torch.logical_xor, torch.eq, torch.ne, torch.lt,
    torch.le, torch.gt, torch.ge, torch.where, torch.add, torch.sub, torch.mul, torch.masked_fill,
    "to", "bool", "float", "half", "bfloat16", "double", "contiguous", "__and__", "__or__", "__invert__",
    "logical_and", "logical_or", "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "masked_fill", "add", "sub",
    "mul", "where", "type_as",
}


def rule_key(target: Any) -> Any:
    """The layout rules' key of an op: ``("method", name)`` for a method name, else the function."""
    return ("method", target) if isinstance(target, str) else target


def rule_keys(targets: Iterable[Any]) -> set:
    """:func:`rule_key` of each of ``targets``."""
    return {rule_key(t) for t in targets}


def is_(node: Any, targets: set) -> bool:
    """Whether ``node`` calls one of ``targets`` (functions, or method names as str)."""
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def tensor(x: Any) -> Optional[torch.Tensor]:
    """The fake value of ``x`` when it is a tensor-valued node."""
    val = fake_value(x) if isinstance(x, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def arguments(node: fx.Node, names: Sequence[str] = ()) -> Dict[str, Any]:
    """``node``'s arguments by parameter name, defaults filled in (the one argument reader of the package).

        torch.sum(x, 1)           -> {"input": x, "dim": 1, "keepdim": False, "dtype": None}
        x.transpose(1, 2)         -> {"input": x, "dim0": 1, "dim1": 2}  (a method: its torch function's signature)
        x.permute(0, 2, 1)        -> {"input": x, "dims": (0, 2, 1)}     (varargs packed into the list parameter)

    Overloads are told apart by the arguments' fake values (``Node.normalized_arguments``); a Python
    function that has no schema is bound with ``inspect.signature``. An op with neither (``operator``
    functions, higher-order ops) is read by ``names``, the names of its positional parameters in order,
    and its keywords as given.
    """
    found = _normalized(node)
    if found is None:
        found = dict(zip(names, node.args))
        found.update(node.kwargs)
    return found


def _normalized(node: fx.Node) -> Optional[Dict[str, Any]]:
    if node.op == "call_method":
        fn = getattr(torch, node.target, None)  # x.sum(1) is torch.sum(x, 1)
        calls = [node.args, (node.args[0], tuple(node.args[1:]))] if node.args[1:] else [node.args]
    elif node.op == "call_function":
        fn, calls = node.target, [node.args]
    else:
        return None
    if fn is None or not callable(fn):
        return None
    for args in calls:
        found = _bind(fn, args, dict(node.kwargs))
        if found is not None:
            return found
    return None


def _bind(fn: Any, args: tuple, kwargs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``fn(*args, **kwargs)``'s arguments by name: by its schema (overloads told apart by the
    arguments' types), else by its Python signature; None if neither binds."""
    kinds = {k: _kind(v) for k, v in kwargs.items()}
    try:
        pair = normalize_function(fn, args, kwargs, tuple(_kind(a) for a in args), kinds,
                                  normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - an ambiguous schema match: try the Python signature
        pair = None
    if pair is not None:
        return dict(pair.kwargs)
    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):  # no Python signature (builtins), or arguments it does not take
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        return None  # (*args, **kwargs): names nothing (higher-order ops, wrappers)
    bound.apply_defaults()
    return dict(bound.arguments)


def _kind(a: Any) -> Any:
    """The type ``normalize_function`` matches an argument by: a node's fake value's."""
    val = fake_value(a) if isinstance(a, fx.Node) else a
    if isinstance(val, torch.SymInt):
        return int
    if isinstance(val, torch.SymFloat):
        return float
    if isinstance(val, (list, tuple)) and val and all(isinstance(fake_value(v) if isinstance(v, fx.Node) else v,
                                                                  torch.Tensor) for v in val):
        return list
    return type(val) if not isinstance(val, torch.Tensor) else torch.Tensor


def same(a: Any, b: Any) -> bool:
    """Whether two sizes are equal for every value of their symbols."""
    return statically_known_true(a == b)




# ops whose result may share memory with their first argument (an in-place op on it writes to that too)
ALIASING = {"getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "transpose",
            "permute", "unsqueeze", "squeeze", "narrow", "select", "flatten", "unflatten", "as_strided", "t",
            "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "bool", "int", "long",
            "detach", "split", "chunk", "unbind", "tensor_split", "diagonal", "movedim", "moveaxis", "swapaxes",
            "swapdims", "unfold", "alias", "view_as_real", "view_as_complex", "real", "imag"}
