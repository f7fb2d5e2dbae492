"""FlexAttention ``mask_mod`` / ``score_mod`` as Triton source: trace to ATen, translate a small op set.

A mod is traced once by ``make_fx`` (fake tensors) with ``b``, ``h`` as (1, 1), ``q_idx`` as
(M, 1) and ``kv_idx`` as (1, N) int64 tensors and ``score`` as (M, N) fp32, i.e. on one
(query tile x key tile) of the kernel, broadcasting as the kernels do. Every node of the
graph is then written as one Triton statement on tiles (:class:`Gen`), cast to the dtype
the trace gave it, so the Triton function computes what the mod computes in PyTorch.

Translated: arithmetic (add, sub, mul, div with every rounding mode, floor_divide,
remainder, fmod, neg, abs, pow by a number), comparisons, logical and bitwise and / or /
xor / not, where, exp, log, tanh, sqrt, rsqrt, sigmoid, sin, cos, floor, ceil, minimum,
maximum, clamp, dtype conversions, constants (Python numbers, one-element tensors, full /
zeros / ones and their ``_like``), shape-only ops (view, expand, unsqueeze, ...), and
reads of a buffer at computed indices (``buf[b, q_idx]``, ``slopes[h]``, ``doc[q_idx]``,
``buf[0]``): ``tl.load`` at the strided offset, negative indices wrapped as in PyTorch,
out-of-range reads masked to 0 (the kernels evaluate a mod on padding rows too, then
mask them). Anything else raises a ValueError naming the op and the fix.

For the backward, ``grad=True`` also carries the derivative of every node with respect to
``score`` (forward-mode, one rule per differentiable op), so the generated function
returns ``(score_mod(score), d score_mod / d score)``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .modops import _TL, BufRef, Val, handler, literal

Tensor = torch.Tensor
M, N = 7, 11  # trace sizes of the query and key tiles (distinct, so the node shapes tell rows from columns)
FIX = "Fix: use kernel='aten' (CPU) or kernel='reference' for this mod"
ARGS = ("b", "h", "q_idx", "kv_idx")

PRELUDE = '''
@triton.jit
def _tanh(x):
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    x3 = x * x * x
    small = x - x3 / 3.0 + 2.0 * x3 * x * x / 15.0  # |x| < 0.04: 1 - e would cancel
    return tl.where(a < 0.04, small, tl.where(x < 0, -t, t))


@triton.jit
def _floordiv_int(a, b):
    q = a // b  # C division (towards zero) in Triton
    return q - (((a - q * b) != 0) & ((a - q * b < 0) != (b < 0))).to(q.dtype)


@triton.jit
def _floordiv_float(a, b):
    return tl.floor(a / b)
'''


class ModError(ValueError):
    """A mod the Triton kernels cannot run (the message names the op and the fix)."""


def trace(fn: Callable, what: str, score: bool, buffers: Sequence[Tensor], device: torch.device) -> fx.GraphModule:
    """``fn`` traced on one tile (module docstring) on ``device`` (where tensors it captures live); the
    buffers are traced by shape and dtype only."""
    from torch.fx.experimental.proxy_tensor import make_fx

    i64 = lambda *s: torch.zeros(s, dtype=torch.int64, device=device)  # noqa: E731
    args = ((torch.zeros(M, N, device=device),) if score else ()) + (i64(1, 1), i64(1, 1), i64(M, 1), i64(1, N))
    args += tuple(torch.zeros(t.shape, dtype=t.dtype, device=device) for t in buffers)
    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    except Exception as e:  # noqa: BLE001 - any failure to trace is the same refusal
        raise ModError(
            f"cp_compile: the Triton kernels could not trace the {what} {getattr(fn, '__name__', fn)!r} on a tile "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Write it with torch operations on its "
            "index tensors (no Python `if` on them, no .item(); index a buffer in one subscript, buf[b, q_idx]), "
            f"and pass the tensors it reads as buffers. {FIX}."
        ) from e


def _shape_ok(shape: Tuple[int, ...]) -> bool:
    """Whether a node's traced shape broadcasts to the tile (M, N) without mixing rows and columns."""
    dims = list(shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    dims = [1] * (2 - len(dims)) + dims if len(dims) <= 2 else dims
    return len(dims) == 2 and dims[0] in (1, M) and dims[1] in (1, N)


def _strides(sizes: Tuple[int, ...]) -> Tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class Gen:
    """Writes the body of one generated function from a traced mod (see the module docstring).

    ``slots``: placeholder index (among the buffers) -> pointer slot; ``constant_slot``: called with a
    get_attr tensor of more than one element, returns its slot. ``lines`` holds the body after
    :meth:`run`, which returns the output's :class:`Val`."""

    def __init__(self, gm: fx.GraphModule, what: str, score: bool, slots: Dict[int, int],
                 constant_slot: Callable[[Tensor], int], grad: bool = False) -> None:
        self.gm, self.what, self.score, self.slots, self.grad = gm, what, score, slots, grad
        self.constant_slot = constant_slot
        self.lines: List[str] = []
        self.env: Dict[fx.Node, Any] = {}
        self.node: Optional[fx.Node] = None

    # ---- helpers ------------------------------------------------------------------
    def fail(self, why: str) -> None:
        raise ModError(f"cp_compile: the Triton kernels cannot run the {self.what}: {why}. {FIX}, or rewrite the "
                       "mod with the ops listed in cp_compile/kernels/triton/modgen.py.")

    def emit(self, expr: str, dtype: torch.dtype, d: Optional[str] = None) -> Val:
        """One statement ``v<i> = tl.cast(expr, dtype)`` (and ``dv<i>`` for the derivative): its value."""
        if dtype not in _TL:
            self.fail(f"{self.op_name()} gives a {dtype} value (translated dtypes: {', '.join(map(str, _TL))})")
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = tl.cast({expr}, {_TL[dtype]})")
        if d is not None:
            self.lines.append(f"d{name} = tl.cast({d}, tl.float32)")
            d = f"d{name}"
        return Val(name, dtype, d)

    def val(self, a: Any, like: Optional[torch.dtype] = None) -> Val:
        """An argument as a value: a node's, or a Python number as a typed scalar (in ``like``'s dtype when
        of the same kind, as PyTorch promotes a number against a tensor)."""
        if isinstance(a, fx.Node):
            if isinstance(self.env[a], BufRef):
                self.env[a] = self.load(self.env[a])  # read once however often it is used
            return self.env[a]
        if isinstance(a, (bool, int, float)):
            kind = {bool: torch.bool, int: torch.int64, float: torch.float32}[type(a)]
            same_kind = like is not None and (like.is_floating_point, like == torch.bool) == (
                kind.is_floating_point, kind == torch.bool)
            dt = like if same_kind else kind
            return Val(f"tl.full([], {literal(a)}, {_TL[dt]})", dt)
        self.fail(f"{self.op_name()} takes an argument {a!r} of type {type(a).__name__}")

    def load(self, ref: BufRef) -> Val:
        if ref.sizes:
            self.fail(f"a buffer is read with {len(ref.sizes)} dim(s) left unindexed (shape {ref.sizes}); "
                      "index every dim at once, e.g. buf[b, q_idx]")
        return self.emit(f"tl.load(BUF{ref.slot} + {ref.offset}, mask={ref.ok}, other=0)", ref.dtype)

    def op_name(self) -> str:
        t = self.node.target if self.node is not None else None
        return f"aten.{t.overloadpacket.__name__}.{t._overloadname}" if hasattr(t, "overloadpacket") else str(t)

    def out_dtype(self) -> torch.dtype:
        return self.node.meta["val"].dtype

    # ---- the walk -------------------------------------------------------------------
    def run(self) -> Val:
        """Translate the traced mod: bind its arguments, emit each op in graph order; the returned value."""
        self._bind_placeholders()
        for node in self.gm.graph.nodes:
            self.node = node
            if node.op == "get_attr":
                self.env[node] = self.constant(getattr(self.gm, node.target))
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "output":
                return self._result(node)
            elif node.op != "placeholder":
                self.fail(f"the traced graph holds a {node.op} node ({node.target})")
        self.fail("the traced graph has no output")

    def _bind_placeholders(self) -> None:
        """The mod's arguments: the leading (score,) b, h, q_idx, kv_idx as the kernel's own values,
        the buffers after them as references into their slots (read where indexed)."""
        n_lead = 5 if self.score else 4
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            self.node = node
            if i < n_lead:
                name = ("score",) + ARGS if self.score else ARGS
                dt = torch.float32 if self.score and i == 0 else torch.int64
                d = "tl.full([], 1.0, tl.float32)" if self.score and i == 0 and self.grad else None
                self.env[node] = self.emit(name[i], dt, d)
            elif (i - n_lead) in self.slots:
                t = node.meta["val"]
                self.env[node] = BufRef(self.slots[i - n_lead], t.dtype, "0", "True", tuple(t.shape),
                                        _strides(tuple(t.shape)))

    def _call(self, node: fx.Node) -> Any:
        """One op through its handler; a value must have the elementwise shape of a tile."""
        shape = tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"), Tensor) else None
        out = handler(node.target, self.fail, self.op_name)(self, *node.args, **node.kwargs)
        if isinstance(out, Val) and (shape is None or not _shape_ok(shape)):
            self.fail(f"{self.op_name()} gives a value of shape {shape} on a tile of {M} query x {N} key "
                      "indices; the kernels evaluate mods elementwise over (q_idx, kv_idx)")
        return out

    def _result(self, node: fx.Node) -> Val:
        """The value the output node returns: one tensor (a 1-tuple unwrapped)."""
        res = node.args[0]
        res = res[0] if isinstance(res, (tuple, list)) and len(res) == 1 else res
        if not isinstance(res, fx.Node):
            self.fail(f"it returns {type(res).__name__}, not one tensor")
        return self.val(res)

    def constant(self, t: Tensor) -> Any:
        """A tensor the mod closes over: one element -> a typed literal, else a buffer slot of its own."""
        if not isinstance(t, Tensor):
            self.fail(f"it reads a constant of type {type(t).__name__}")
        if t.numel() == 1 and t.dim() == 0:
            return Val(f"tl.full([], {literal(t.item())}, {_TL[t.dtype]})", t.dtype)
        return BufRef(self.constant_slot(t), t.dtype, "0", "True", tuple(t.shape), _strides(tuple(t.shape)))
