"""The ATen ops :mod:`.modgen` translates to Triton, one handler each, with their derivative rules.

A handler takes the generator (:class:`.modgen.Gen`) and the node's arguments and returns a
:class:`Val` (or, for buffer reads in progress, a :class:`BufRef`). ``g.grad``
asks for the derivative with respect to ``score`` too: ``Val.d`` (None = 0). An op without a
derivative rule is refused when a value that depends on ``score`` flows into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

_TL = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
       torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
       torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


@dataclass
class Val:
    """A traced value in the generated code: ``expr`` (a name or a literal), its torch dtype and,
    with ``grad``, the expression of its derivative with respect to ``score`` (None: zero)."""

    expr: str
    dtype: torch.dtype
    d: Optional[str] = None


@dataclass
class BufRef:
    """A buffer, or a buffer indexed in its leading dims: slot ``BUF<slot>`` at ``offset`` (an
    expression), in-range mask ``ok``, and the sizes / strides of the dims still to index."""

    slot: int
    dtype: torch.dtype
    offset: str
    ok: str
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]


def literal(v: Any) -> str:
    """A Python number as Triton source (infinities and NaN as float("..."))."""
    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, float) and not math.isfinite(v):
        return f'float("{v}")'
    return repr(v)


_ZERO = "tl.full([], 0.0, tl.float32)"


def _d(v: Val) -> str:
    return v.d if v.d is not None else _ZERO


def _terms(g, *terms) -> Optional[str]:
    """The sum of the (expression, sign) terms that exist (a missing tangent is zero, not ``x * 0``,
    which would be NaN where x is infinite); None when none does or no derivative is asked."""
    out = ""
    for expr, sign in terms:
        if g.grad and expr:
            out = f"{out} {sign} {expr}" if out else (expr if sign == "+" else f"-{expr}")
    return out or None


def _no_grad(g, *vals: Val) -> None:
    """Refuse an op without a derivative rule on a score-dependent value."""
    if g.grad and any(v.d is not None for v in vals):
        g.fail(f"{g.op_name()} is applied to a value that depends on score, and has no derivative rule here")


def _cmp(op: str) -> Callable:
    def fn(g, a, b):
        x = g.val(a)
        y = g.val(b, x.dtype)
        return g.emit(f"{x.expr} {op} {y.expr}", torch.bool)
    return fn


def _logic(op: str) -> Callable:
    def fn(g, a, b):
        x, y = g.val(a), g.val(b)
        _no_grad(g, x, y)
        if g.out_dtype() == torch.bool:
            return g.emit(f"({x.expr} != 0) {op} ({y.expr} != 0)", torch.bool)
        return g.emit(f"{x.expr} {op} {y.expr}", g.out_dtype())
    return fn


def _add(sign: str) -> Callable:
    def fn(g, a, b, alpha=1):
        x = g.val(a)
        y = g.val(b, x.dtype)
        ya = y.expr if alpha == 1 else f"({y.expr} * {literal(alpha)})"
        dy = None if y.d is None else (y.d if alpha == 1 else f"({y.d} * {literal(alpha)})")
        d = _terms(g, (x.d, "+"), (dy, sign))
        return g.emit(f"{x.expr} {sign} {ya}", g.out_dtype(), d)
    return fn


def _mul(g, a, b):
    x = g.val(a)
    y = g.val(b, x.dtype)
    d = _terms(g, (x.d and f"{x.d} * {y.expr}", "+"), (y.d and f"{x.expr} * {y.d}", "+"))
    return g.emit(f"{x.expr} * {y.expr}", g.out_dtype(), d)


def _div(g, a, b, rounding_mode: Optional[str] = None):
    x = g.val(a)
    y = g.val(b, x.dtype)
    out = g.out_dtype()
    if rounding_mode is None:
        d = _terms(g, (x.d and f"{x.d} / {y.expr}", "+"), (y.d and f"{x.expr} * {y.d} / ({y.expr} * {y.expr})", "-"))
        return g.emit(f"tl.cast({x.expr}, {_tl(out)}) / tl.cast({y.expr}, {_tl(out)})", out, d)
    _no_grad(g, x, y)
    if rounding_mode == "trunc":
        return g.emit(_trunc_div(x, y) if out.is_floating_point else f"{x.expr} // {y.expr}", out)  # C division
    kind = "float" if out.is_floating_point else "int"
    return g.emit(f"_floordiv_{kind}({x.expr}, {y.expr})", out)


def _trunc_div(x: Val, y: Val) -> str:
    q = f"({x.expr} / {y.expr})"
    return f"tl.where({q} < 0, tl.ceil({q}), tl.floor({q}))"


def _floor_divide(g, a, b):
    return _div(g, a, b, rounding_mode="floor")


def _remainder(g, a, b):
    x = g.val(a)
    y = g.val(b, x.dtype)
    _no_grad(g, x, y)
    kind = "float" if g.out_dtype().is_floating_point else "int"
    return g.emit(f"{x.expr} - _floordiv_{kind}({x.expr}, {y.expr}) * {y.expr}", g.out_dtype())


def _fmod(g, a, b):
    x = g.val(a)
    y = g.val(b, x.dtype)
    _no_grad(g, x, y)
    if g.out_dtype().is_floating_point:
        return g.emit(f"{x.expr} - ({_trunc_div(x, y)}) * {y.expr}", g.out_dtype())
    return g.emit(f"{x.expr} % {y.expr}", g.out_dtype())


def _tl(dt: torch.dtype) -> str:
    return _TL[dt]


# unary ops: (value template, derivative factor template over x (input) and y (output), or None = no rule)
_UNARY = {
    "neg": ("-{x}", "-1.0"),
    "exp": ("tl.exp({x})", "{y}"),
    "log": ("tl.log({x})", "1.0 / {x}"),
    "tanh": ("_tanh({x})", "1.0 - {y} * {y}"),
    "sqrt": ("tl.sqrt({x})", "0.5 / {y}"),
    "rsqrt": ("tl.rsqrt({x})", "-0.5 * {y} * {y} * {y}"),
    "sigmoid": ("tl.sigmoid({x})", "{y} * (1.0 - {y})"),
    "sin": ("tl.sin({x})", "tl.cos({x})"),
    "cos": ("tl.cos({x})", "-tl.sin({x})"),
    "abs": ("tl.abs({x})", "tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0))"),
    "floor": ("tl.floor({x})", "0.0"),
    "ceil": ("tl.ceil({x})", "0.0"),
}


def _unary(name: str) -> Callable:
    value, factor = _UNARY[name]

    def fn(g, a):
        x = g.val(a)
        out = g.out_dtype()
        if name in ("floor", "ceil") and not x.dtype.is_floating_point:
            return g.emit(x.expr, out)
        src = f"tl.cast({x.expr}, {_tl(out)})" if out.is_floating_point else x.expr
        y = g.emit(value.format(x=src), out)
        if g.grad and x.d is not None:
            y.d = g.emit(f"{_d(x)} * ({factor.format(x=src, y=y.expr)})", torch.float32).expr
        return y
    return fn


def _not(g, a):
    x = g.val(a)
    _no_grad(g, x)
    return g.emit(f"{x.expr} == 0" if g.out_dtype() == torch.bool else f"~{x.expr}", g.out_dtype())


def _where(g, c, a, b):
    cond = g.val(c)
    x = g.val(a, g.out_dtype())
    y = g.val(b, g.out_dtype())
    d = f"tl.where({cond.expr} != 0, {_d(x)}, {_d(y)})" if g.grad and (x.d or y.d) else None
    return g.emit(f"tl.where({cond.expr} != 0, {x.expr}, {y.expr})", g.out_dtype(), d)


def _minmax(fn_name: str, pick: str) -> Callable:
    def fn(g, a, b):
        x = g.val(a)
        y = g.val(b, x.dtype)
        out = g.out_dtype()
        xs, ys = f"tl.cast({x.expr}, {_tl(out)})", f"tl.cast({y.expr}, {_tl(out)})"
        d = f"tl.where({xs} {pick} {ys}, {_d(x)}, {_d(y)})" if g.grad and (x.d or y.d) else None
        return g.emit(f"tl.{fn_name}({xs}, {ys})", out, d)
    return fn


def _clamp(g, a, lo=None, hi=None):
    x = g.val(a)
    out = g.out_dtype()
    expr, keep = f"tl.cast({x.expr}, {_tl(out)})", []
    for bound, fn_name, cmp in ((lo, "maximum", ">="), (hi, "minimum", "<=")):
        if bound is not None:
            b = g.val(bound, out)
            keep.append(f"({x.expr} {cmp} {b.expr})")
            expr = f"tl.{fn_name}({expr}, tl.cast({b.expr}, {_tl(out)}))"
    d = f"tl.where({' & '.join(keep) or 'True'}, {_d(x)}, 0.0)" if g.grad and x.d else None
    return g.emit(expr, out, d)


def _pow(g, a, e):
    x = g.val(a)
    if not isinstance(e, (int, float)) or not (float(e).is_integer() and 0 <= e <= 8 or e in (0.5, -0.5, -1)):
        g.fail(f"{g.op_name()} with exponent {e!r} (translated: 0..8, 0.5, -0.5, -1)")
    out = g.out_dtype()
    xs = f"tl.cast({x.expr}, {_tl(out)})"
    expr = {0.5: f"tl.sqrt({xs})", -0.5: f"tl.rsqrt({xs})", -1: f"1.0 / {xs}"}.get(e)
    if expr is None:
        expr = " * ".join([xs] * int(e)) if e else f"tl.full([], 1, {_tl(out)})"
    d = None
    if g.grad and x.d is not None:
        d = f"{_d(x)} * {literal(float(e))} * " + (f"({expr}) / {xs}" if e != 0 else "0.0")
    return g.emit(expr, out, d)


def _convert(g, a, *args, dtype=None, **kwargs):
    x = g.val(a)
    out = g.out_dtype()
    if out == torch.bool and x.dtype != torch.bool:
        return g.emit(f"{x.expr} != 0", out)
    d = x.d if out.is_floating_point else None
    return g.emit(x.expr, out, d)


def _same(g, a, *args, **kwargs):
    """Shape-only ops: the value is unchanged (the node's shape was checked to fit the tile)."""
    v = g.env[a] if hasattr(a, "op") else g.val(a)
    return v


def _fill(g, *args, **kwargs):
    """A constant tensor (full / zeros / ones / scalar_tensor and their _like)."""
    name = g.node.target.overloadpacket.__name__
    value = {"zeros": 0, "zeros_like": 0, "ones": 1, "ones_like": 1}.get(name)
    if value is None:
        value = args[1] if name in ("full", "full_like") else args[0]
    out = g.out_dtype()
    return Val(f"tl.full([], {literal(out_cast(value, out))}, {_tl(out)})", out)


def out_cast(v: Any, dt: torch.dtype) -> Any:
    return bool(v) if dt == torch.bool else (float(v) if dt.is_floating_point else int(v))


def _index(g, buf, indices):
    ref = g.env[buf] if hasattr(buf, "op") else None
    if not isinstance(ref, BufRef):
        g.fail(f"{g.op_name()} indexes a computed value; only the mod's buffers can be read at computed indices")
    if any(i is None for i in indices) or len(indices) > len(ref.sizes):
        g.fail(f"{g.op_name()} with a slice or too many indices; index the buffer's leading dims with tensors, "
               "e.g. buf[b, q_idx]")
    offset, ok = ref.offset, ref.ok
    for i, size, stride in zip(indices, ref.sizes, ref.strides):
        v = g.val(i)
        if v.dtype == torch.bool or v.dtype.is_floating_point:
            g.fail(f"{g.op_name()} with a {v.dtype} index (a mask or float index)")
        w = g.emit(f"tl.where({v.expr} < 0, {v.expr} + {size}, {v.expr})", torch.int64)
        offset, ok = f"{offset} + {w.expr} * {stride}", f"{ok} & ({w.expr} >= 0) & ({w.expr} < {size})"
    n = len(indices)
    return BufRef(ref.slot, ref.dtype, offset, ok, ref.sizes[n:], ref.strides[n:])


def _select(g, buf, dim, index):
    ref = g.env[buf] if hasattr(buf, "op") else None
    if not isinstance(ref, BufRef) or dim != 0 or not isinstance(index, int):
        g.fail(f"{g.op_name()} other than a buffer's leading dim at a constant index")
    return _index(g, buf, [index])


_TABLE = {
    "add": _add("+"), "sub": _add("-"), "rsub": None, "mul": _mul, "div": _div, "floor_divide": _floor_divide,
    "remainder": _remainder, "fmod": _fmod, "pow": _pow,
    "eq": _cmp("=="), "ne": _cmp("!="), "lt": _cmp("<"), "le": _cmp("<="), "gt": _cmp(">"), "ge": _cmp(">="),
    "logical_and": _logic("&"), "logical_or": _logic("|"), "logical_xor": _logic("^"),
    "bitwise_and": _logic("&"), "bitwise_or": _logic("|"), "bitwise_xor": _logic("^"),
    "__and__": _logic("&"), "__or__": _logic("|"), "__xor__": _logic("^"),
    "logical_not": _not, "bitwise_not": _not, "where": _where,
    "minimum": _minmax("minimum", "<="), "maximum": _minmax("maximum", ">="), "clamp": _clamp,
    "clamp_min": lambda g, a, lo: _clamp(g, a, lo, None), "clamp_max": lambda g, a, hi: _clamp(g, a, None, hi),
    "_to_copy": _convert, "to": _convert, "type_as": _convert,
    "alias": _same, "clone": _same, "detach": _same, "lift_fresh_copy": _same, "expand": _same, "view": _same,
    "_unsafe_view": _same, "reshape": _same, "unsqueeze": _same, "squeeze": _same, "contiguous": _same,
    "full": _fill, "full_like": _fill, "zeros": _fill, "zeros_like": _fill, "ones": _fill, "ones_like": _fill,
    "scalar_tensor": _fill, "index": _index, "select": _select,
    **{name: _unary(name) for name in _UNARY},
}
del _TABLE["rsub"]


def handler(target: Any, fail: Callable[[str], None], op_name: Callable[[], str]) -> Callable:
    """The handler of an ATen op, or a refusal naming it."""
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    if name not in _TABLE:
        fail(f"{op_name()} is not among the ops translated to Triton")
    return _TABLE[name]
