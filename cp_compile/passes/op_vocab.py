"""The op vocabulary the attention passes share: which FX targets are products, softmaxes,
casts, views, scales, biases and masks, and how to read a node's arguments and fake value.

Dynamo's graph names one op several ways (``operator.matmul``, ``torch.matmul``, the method
``"matmul"``, ``"__matmul__"``); each set below holds every spelling, so a pass asks
``is_(node, MATMUL)`` and never lists them again.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .fx_utils import IN_PLACE_OPERATORS, fake_value, writes_in_place  # noqa: F401 (re-exported: part of the vocabulary)
from .analyze.score_fn import scaled_dot_product_attention_with_scores

# attention the ring replaces: SDPA, and SDPA with a function of the scores (score_fn.py: soft-capping)
SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                scaled_dot_product_attention_with_scores}
MATMUL = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm", "__matmul__"}
EINSUM = {torch.einsum, torch.functional.einsum}
BADDBMM = {torch.baddbmm, "baddbmm"}
SOFTMAX = {F.softmax, torch.softmax, torch.nn.functional.softmax, "softmax", torch.special.softmax}
CASTS = {"to", "type_as", "float", "half", "bfloat16", "double", "type", "contiguous", "clone"}
VIEWS = {"view", "reshape", "flatten", "unflatten", torch.reshape, torch.flatten, torch.unflatten}
MUL = {operator.mul, torch.mul, "mul", operator.imul}
DIV = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide", operator.itruediv}
ADD = {operator.add, torch.add, "add", operator.iadd}
SUB = {operator.sub, torch.sub, "sub", operator.isub}
MASKED_FILL = {torch.masked_fill, "masked_fill"}
WHERE = {torch.where, "where"}
DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout}


def is_(node: Any, targets: set) -> bool:
    """Whether ``node`` calls one of ``targets`` (functions, or method names as str)."""
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def tensor(x: Any) -> Optional[torch.Tensor]:
    """The fake value of ``x`` when it is a tensor-valued node."""
    val = fake_value(x) if isinstance(x, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` of ``node`` by position, else by keyword ``name``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def same(a: Any, b: Any) -> bool:
    """Whether two sizes are equal for every value of their symbols."""
    return statically_known_true(a == b)




# ops whose result may share memory with their first argument (an in-place op on it writes to that too)
ALIASING = {"getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "transpose",
            "permute", "unsqueeze", "squeeze", "narrow", "select", "flatten", "unflatten", "as_strided", "t",
            "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "bool", "int", "long",
            "detach", "split", "chunk", "unbind", "tensor_split", "diagonal", "movedim", "moveaxis", "swapaxes",
            "swapdims", "unfold", "alias", "view_as_real", "view_as_complex", "real", "imag"}
