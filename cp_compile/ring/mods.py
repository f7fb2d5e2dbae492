"""FlexAttention-style ``mask_mod`` / ``score_mod`` for the ring, over *global* positions.

The ring op takes mods as a string key (custom ops carry only tensors and plain values):
:func:`register_mods` stores the functions under a key that is the same on every rank
for the same functions, and the op looks them up (:func:`lookup`). Semantics are
FlexAttention's:

* ``mask_mod(b, h, q_idx, kv_idx, *mask_buffers) -> bool`` (True = attend);
* ``score_mod(score, b, h, q_idx, kv_idx, *score_buffers) -> score``, ``score`` being
  ``q·k·scale`` in fp32 (fp64 for fp64 inputs),

with ``q_idx`` / ``kv_idx`` the global token positions (never the local row index), and
the buffers (document ids, per-head slopes, ...) passed whole. Score buffers may be learned (a
relative-position bias table, ALiBi slopes): the backward then returns their gradient
(:attr:`Mods.learned`); mask buffers are constants. Each ring
rectangle evaluates the mods on its own ``(B, H, Lq, Lk)`` grid with ``torch.vmap`` over
(b, h, q, kv), as FlexAttention's ``create_mask`` does, so a mod written for
FlexAttention runs unchanged.
"""

from __future__ import annotations

import hashlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor
MaskMod = Callable[..., Tensor]
ScoreMod = Callable[..., Tensor]
_SMALL = 1 << 16  # captured tensors up to this many elements are hashed by value


@dataclass(frozen=True)
class Mods:
    """The mods of one ring call and the tensors they read.

    ``learned``: indices of the score buffers whose gradient the backward computes (learned biases:
    a relative-position table, ALiBi slopes); the explicit-scores kernel adds each rectangle's
    d(loss)/d(buffer) into ``grads`` (:meth:`add_grads`, fp32 or fp64 accumulators, one per learned
    buffer). mask_buffers are always constants (a boolean mask has no gradient)."""

    mask_mod: Optional[MaskMod] = None
    score_mod: Optional[ScoreMod] = None
    mask_buffers: Tuple[Tensor, ...] = ()
    score_buffers: Tuple[Tensor, ...] = ()
    learned: Tuple[int, ...] = ()
    grads: List[Optional[Tensor]] = field(default_factory=list, compare=False)

    def with_buffers(self, mask_buffers: Optional[Sequence[Tensor]], score_buffers: Optional[Sequence[Tensor]],
                     learned: Sequence[int] = ()) -> "Mods":
        """This entry with the buffers of one call (and fresh gradient accumulators for ``learned``)."""
        learned = tuple(learned)
        return Mods(self.mask_mod, self.score_mod, tuple(mask_buffers or ()), tuple(score_buffers or ()), learned,
                    [None] * len(learned))

    def learned_values(self, dtype: torch.dtype) -> Tuple[Tensor, ...]:
        """The learned score buffers as the primals of a vjp: detached, at least ``dtype``'s precision."""
        return tuple(_grad_dtype(self.score_buffers[i], dtype) for i in self.learned)

    def add_grads(self, grads: Sequence[Tensor]) -> None:
        """Accumulate one rectangle's d(loss)/d(learned buffer), each in fp32 (fp64 for fp64)."""
        for j, g in enumerate(grads):
            acc = self.grads[j]
            self.grads[j] = g.to(_acc_dtype(g.dtype)).clone() if acc is None else acc.add_(g)

    def buffer_grads(self) -> List[Tensor]:
        """The accumulated gradients in their buffers' dtypes (zeros for a buffer no rectangle reached)."""
        bufs = [self.score_buffers[i] for i in self.learned]
        return [torch.zeros_like(b) if g is None else g.to(b.dtype) for b, g in zip(bufs, self.grads)]

    def mask(self, b: int, h: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``mask_mod`` on the grid (b, h, q_pos x k_pos): bool (B, H, Lq, Lk), True = attend."""
        if self.mask_mod is None:
            return torch.ones(1, 1, len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
        out = _evaluate(self.mask_mod, "mask_mod", (), _indices(b, h, q_pos, k_pos), self.mask_buffers)
        return _as_grid(out, "mask_mod", (b, h, len(q_pos), len(k_pos))).to(torch.bool)

    def scores(self, s: Tensor, q_pos: Tensor, k_pos: Tensor, learned: Optional[Sequence[Tensor]] = None) -> Tensor:
        """``score_mod`` applied to scores ``s`` (B, H, Lq, Lk) at global positions; ``learned``: values
        in place of the learned buffers (the primals of the backward's vjp)."""
        b, h, lq, lk = s.shape
        buffers = self.score_buffers
        if learned is not None:
            buffers = list(buffers)
            for i, t in zip(self.learned, learned):
                buffers[i] = t
            buffers = tuple(buffers)
        out = _evaluate(self.score_mod, "score_mod", (s,), _indices(b, h, q_pos, k_pos), buffers)
        return _as_grid(out, "score_mod", (b, h, lq, lk)).to(s.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grad_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` detached, promoted to at least ``dtype`` and fp32 (a bf16 table's gradient is not summed in bf16)."""
    return t.detach().to(torch.promote_types(torch.promote_types(t.dtype, dtype), torch.float32))


def _evaluate(fn: Callable, what: str, score: Tuple[Tensor, ...], idx: Tuple[Tensor, ...],
              buffers: Tuple[Tensor, ...]) -> Tensor:
    """``fn(*score, b, h, q, kv, *buffers)`` on the (B, H, Lq, Lk) grid: by ``torch.vmap`` (FlexAttention's
    way), else by broadcasting the indices as (B,1,1,1), (1,H,1,1), (1,1,Lq,1), (1,1,1,Lk) (what
    runs under a dispatch mode that cannot see through vmap's batched tensors, and what a traced
    GraphModule that asks a batched tensor ``is_contiguous`` needs). A function vmap failed on once
    is broadcast first from then on, so each rectangle does not pay a failing vmap again."""
    shaped = tuple(t.view([-1 if d == i else 1 for d in range(4)]) for i, t in enumerate(idx))
    if _known_unvmappable(fn):
        try:
            return fn(*score, *shaped, *buffers)
        except Exception:  # noqa: BLE001 - not broadcastable after all: vmap below decides
            _BROADCAST_FIRST.discard(fn)
    try:
        return _vmap_bhqkv(fn, len(buffers), score=bool(score))(*score, *idx, *buffers)
    except Exception as vmap_error:  # noqa: BLE001 - retried by broadcasting, re-raised below if that fails too
        try:
            out = fn(*score, *shaped, *buffers)
        except Exception:  # noqa: BLE001
            raise ValueError(
                f"cp_compile: the {what} {getattr(fn, '__qualname__', fn)!r} failed on the ring's (b, h, q_idx, "
                f"kv_idx) grid ({vmap_error}). Fix: write it as for FlexAttention, with torch operations on its "
                "index tensors (no Python `if` on them, no .item()), and pass the tensors it reads as buffers."
            ) from vmap_error
        if _known_unvmappable(fn) is False:
            _BROADCAST_FIRST.add(fn)
        return out


_BROADCAST_FIRST: set = set()  # mods vmap could not run; registered mods live as long anyway


def _known_unvmappable(fn: Callable) -> Optional[bool]:
    """Whether vmap already failed on ``fn`` (None: ``fn`` is unhashable, so this is not remembered)."""
    try:
        return fn in _BROADCAST_FIRST
    except TypeError:
        return None


def _indices(b: int, h: int, q_pos: Tensor, k_pos: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dev = q_pos.device
    return (torch.arange(b, device=dev), torch.arange(h, device=dev), q_pos.long(), k_pos.long())


def _vmap_bhqkv(fn: Callable, n_buffers: int, *, score: bool) -> Callable:
    """``fn`` vectorised over (b, h, q, kv) like FlexAttention: the innermost vmap runs over kv.

    With ``score``, the first argument is the (B, H, Lq, Lk) score grid, mapped along
    each of its dims together with the matching index."""
    rest = (None,) * n_buffers
    for dim in (3, 2, 1, 0):  # kv innermost, b outermost
        idx = tuple(0 if i == dim else None for i in range(4))
        fn = torch.vmap(fn, in_dims=((0,) if score else ()) + idx + rest, out_dims=0)
    return fn


def _as_grid(out: Any, what: str, shape: Tuple[int, int, int, int]) -> Tensor:
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"cp_compile: the {what} returned {type(out).__name__}, not a tensor. Fix: write it with torch "
            "operations on its index arguments (as for FlexAttention), e.g. `return q_idx >= kv_idx`."
        )
    return out.expand(shape)


def lookup(key: str) -> Mods:
    """The mods registered under ``key`` (without buffers), or an error naming the fix."""
    if key not in _REGISTRY:
        raise ValueError(
            f"cp_compile: no mask_mod/score_mod is registered under {key!r} in this process. "
            "Fix: call cp_compile.ring.mods.register_mods(...) on every rank before the ring op runs "
            "(cp_compile.ring_attention(mask_mod=..., score_mod=...) does it for you)."
        )
    return _REGISTRY[key]


def register_mods(mask_mod: Optional[MaskMod] = None, score_mod: Optional[ScoreMod] = None) -> str:
    """Store the mods and return their key: deterministic, the same on every rank for the same functions.

    Registering again under the same key replaces the entry. The key hashes each
    function's code (a GraphModule's ``.code`` and its tensors, or a Python function's
    qualname, bytecode, constants, defaults and captured values), so two different
    functions do not share a key unless they compute the same thing.
    """
    if mask_mod is None and score_mod is None:
        return ""
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"cp_compile: {name} must be callable, got {type(fn).__name__}. "
                             f"Fix: pass a function {name}(b, h, q_idx, kv_idx, ...).")
    h = hashlib.sha256()
    for fn in (mask_mod, score_mod):
        h.update(b"|")
        _hash_obj(h, fn, depth=0)
    key = "mods:" + h.hexdigest()[:24]
    _REGISTRY[key] = Mods(mask_mod, score_mod)
    return key


_REGISTRY: Dict[str, Mods] = {}


def _hash_tensor(h: "hashlib._Hash", t: Tensor) -> None:
    if t.requires_grad:
        raise ValueError(
            f"cp_compile: a mask_mod / score_mod captures a tensor of shape {tuple(t.shape)} that requires grad; the "
            "ring would use it as a constant and drop its gradient. Fix: pass it as score_buffers=[...] (an extra "
            "argument of the score_mod, which trains), or capture t.detach() if it is not trained.")
    h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
    if t.numel() > _SMALL or t.is_meta or isinstance(t, torch._subclasses.FakeTensor):
        return  # shape and dtype only: no values to read (or too many to read on every call)
    try:
        h.update(t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    except (RuntimeError, TypeError):  # a dtype or tensor subclass without plain values
        pass


def _hash_code(h: "hashlib._Hash", code: types.CodeType, depth: int) -> None:
    h.update(code.co_qualname.encode() if hasattr(code, "co_qualname") else code.co_name.encode())
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        _hash_obj(h, const, depth + 1)


def _hash_obj(h: "hashlib._Hash", obj: Any, depth: int) -> None:
    """Feed a process-independent description of ``obj`` (no ids or addresses) into ``h``."""
    if depth > 6:
        h.update(type(obj).__name__.encode())
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, complex)):
        h.update(repr(obj).encode())
    elif isinstance(obj, torch.Tensor):
        _hash_tensor(h, obj)
    elif isinstance(obj, types.CodeType):
        _hash_code(h, obj, depth)
    elif isinstance(obj, (tuple, list, frozenset)):
        _hash_items(h, obj, depth)
    elif isinstance(obj, torch.fx.GraphModule):
        _hash_graph_module(h, obj)
    elif isinstance(obj, types.FunctionType):
        _hash_function(h, obj, depth)
    elif isinstance(obj, types.MethodType):
        _hash_obj(h, obj.__func__, depth + 1)
        h.update(type(obj.__self__).__qualname__.encode())
    elif hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
        _hash_obj(h, (obj.func, obj.args, tuple(sorted(obj.keywords.items()))), depth + 1)
    else:
        _hash_instance(h, obj, depth)


def _hash_items(h: "hashlib._Hash", obj: Union[tuple, list, frozenset], depth: int) -> None:
    """A tuple or list item by item, a frozenset in a fixed order (by repr)."""
    h.update(f"{type(obj).__name__}{len(obj)}".encode())
    for x in (sorted(obj, key=repr) if isinstance(obj, frozenset) else obj):
        _hash_obj(h, x, depth + 1)


def _hash_graph_module(h: "hashlib._Hash", gm: torch.fx.GraphModule) -> None:
    """A traced mod: its code, then its parameters, buffers and public tensor attributes by name."""
    h.update(gm.code.encode())
    for name, t in sorted({**dict(gm.named_parameters()), **dict(gm.named_buffers())}.items()):
        h.update(name.encode())
        _hash_tensor(h, t)
    for name, value in sorted(vars(gm).items()):
        if isinstance(value, torch.Tensor) and not name.startswith("_"):
            h.update(name.encode())
            _hash_tensor(h, value)


def _hash_function(h: "hashlib._Hash", fn: types.FunctionType, depth: int) -> None:
    """A Python function: its qualified name, code, defaults and the contents of its filled closure cells."""
    h.update(f"{fn.__module__}.{fn.__qualname__}".encode())
    _hash_code(h, fn.__code__, depth)
    _hash_obj(h, fn.__defaults__, depth + 1)
    _hash_obj(h, tuple(c.cell_contents for c in fn.__closure__ or () if _filled(c)), depth + 1)


def _hash_instance(h: "hashlib._Hash", obj: Any, depth: int) -> None:
    """Any other object: its class, and for a callable instance the class's ``__call__``."""
    h.update(f"{type(obj).__module__}.{type(obj).__qualname__}".encode())
    if callable(obj) and hasattr(type(obj), "__call__"):
        _hash_obj(h, type(obj).__call__, depth + 1)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True
