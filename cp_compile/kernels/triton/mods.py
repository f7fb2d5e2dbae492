"""FlexAttention mods compiled into the Triton step kernels: generated ``@triton.jit`` functions.

:func:`kernel_mods` turns the ``mask_mod`` / ``score_mod`` of a ring call (:class:`cp_compile.ring.mods.Mods`)
into :class:`KernelMods`: three generated Triton functions (:mod:`.modgen`) that the kernels
take as ``tl.constexpr`` arguments and call on each (query tile x key tile)::

    MASK_MOD(b, h, q_idx, kv_idx, BUF0, BUF1, BUF2, BUF3) -> bool, True = attend
    SCORE_MOD(score, b, h, q_idx, kv_idx, BUF0, ..., BUF3) -> score'              (forward)
    SCORE_GRAD(score, b, h, q_idx, kv_idx, BUF0, ..., BUF3) -> (score', d score'/d score)   (backward)

with ``b``, ``h`` scalars (batch row, *query* head), ``q_idx`` (BLOCK_M, 1) and ``kv_idx``
(1, BLOCK_N) global positions, ``score`` (BLOCK_M, BLOCK_N) fp32 (``scale · q·k``). The tensors
the mods read (their buffers, and tensors they close over) take the pointer slots ``BUF0..3``
in that order; their shapes are baked into the source (contiguous strides), so a new shape
generates a new function.

Triton reads a JIT function's source with ``inspect``, so the generated module is written to
``$CP_COMPILE_CACHE_DIR/triton_mods/`` (default ``~/.cache/cp_compile``), named by the hash of
its source, and imported from there. Functions are generated once per (mods, buffer shapes
and dtypes, device) in a process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from .modgen import FIX, PRELUDE, Gen, ModError, trace

Tensor = torch.Tensor
N_SLOTS = 4  # buffer pointer slots of the kernels
SLOTS = ", ".join(f"BUF{i}" for i in range(N_SLOTS))


@dataclass(frozen=True)
class KernelMods:
    """The generated functions (None: no such mod) and where each buffer slot's tensor comes from:
    ``("mask", i)`` / ``("score", i)`` = the call's i-th mask / score buffer, or a constant tensor."""

    mask: Any
    score: Any
    score_grad: Any
    plan: Tuple[Any, ...]

    def buffers(self, mods: Any, device: torch.device, placeholder: Tensor) -> Tuple[Tensor, ...]:
        """The N_SLOTS pointer arguments for one call (contiguous; unused slots hold ``placeholder``)."""
        out = []
        for src in self.plan:
            if not isinstance(src, Tensor):
                src = (mods.mask_buffers if src[0] == "mask" else mods.score_buffers)[src[1]]
            out.append(src.to(device).contiguous())
        return tuple(out) + (placeholder,) * (N_SLOTS - len(out))


class ModFns(NamedTuple):
    """The kernels' constexpr function arguments (None: no such mod)."""

    mask: Any
    score: Any
    score_grad: Any


def mod_args(mods: Any, device: torch.device, placeholder: Tensor) -> Tuple[ModFns, Tuple[Tensor, ...]]:
    """(functions, N_SLOTS buffer pointers) of a kernel launch; without mods, Nones and ``placeholder``s
    (any tensor on the device, never read)."""
    km = kernel_mods(mods, device)
    if km is None:
        return ModFns(None, None, None), (placeholder,) * N_SLOTS
    return ModFns(km.mask, km.score, km.score_grad), km.buffers(mods, device, placeholder)


_CACHE: Dict[Any, KernelMods] = {}


def kernel_mods(mods: Any, device: torch.device) -> Optional[KernelMods]:
    """The Triton functions of ``mods`` (None without mods); a :class:`.modgen.ModError` (a ValueError
    naming the op and the fix) for a mod outside the translated op set."""
    mask_mod, score_mod = getattr(mods, "mask_mod", None), getattr(mods, "score_mod", None)
    if mods is None or (mask_mod is None and score_mod is None):
        return None
    metas = tuple(tuple((tuple(t.shape), t.dtype) for t in bufs) for bufs in (mods.mask_buffers, mods.score_buffers))
    key = (mask_mod, score_mod, metas, str(device))
    try:
        hit = _CACHE.get(key)
    except TypeError:  # an unhashable mod: generated again each call
        key, hit = None, None
    if hit is None:
        hit = _generate(mask_mod, score_mod, mods.mask_buffers, mods.score_buffers, device)
        if key is not None:
            _CACHE[key] = hit
    return hit


class _Slots:
    """Assigns the pointer slots: the buffers a mod really reads, then its constants."""

    def __init__(self, device: torch.device) -> None:
        self.plan: List[Any] = []
        self.device = device
        self.seen: Dict[int, int] = {}

    def of_buffers(self, gm: fx.GraphModule, which: str, lead: int) -> Dict[int, int]:
        slots = {}
        for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            if i >= lead and node.users:
                slots[i - lead] = self._take((which, i - lead))
        return slots

    def constant(self, t: Tensor) -> int:
        """The slot of a captured tensor (the same one for both passes over a score_mod)."""
        if id(t) not in self.seen:
            self.seen[id(t)] = self._take(t.detach().to(self.device).contiguous())
        return self.seen[id(t)]

    def _take(self, src: Any) -> int:
        if len(self.plan) == N_SLOTS:
            raise ModError(f"cp_compile: the mods read more than {N_SLOTS} tensors (buffers and captured tensors "
                           f"of more than one element); the Triton kernels take {N_SLOTS}. Fix: stack them into "
                           f"fewer buffers, or use kernel='aten' (CPU) or kernel='reference'.")
        self.plan.append(src)
        return len(self.plan) - 1


def _function(name: str, args: str, gen: Gen, ret: str) -> str:
    body = "\n".join(f"    {line}" for line in gen.lines)
    return f"\n\n@triton.jit\ndef {name}({args}, {SLOTS}):\n{body}\n    return {ret}\n"


def _generate(mask_mod: Any, score_mod: Any, mask_buffers: Sequence[Tensor], score_buffers: Sequence[Tensor],
              device: torch.device) -> KernelMods:
    slots = _Slots(device)
    src = ["import triton\nimport triton.language as tl\n", PRELUDE]
    names = []
    if mask_mod is not None:
        gm = trace(mask_mod, "mask_mod", False, mask_buffers, device)
        gen = Gen(gm, "mask_mod", False, slots.of_buffers(gm, "mask", 4), slots.constant)
        out = gen.run()
        ret = out.expr if out.dtype == torch.bool else f"{out.expr} != 0"
        src.append(_function("mask_mod", "b, h, q_idx, kv_idx", gen, ret))
        names.append("mask_mod")
    if score_mod is not None:
        gm = trace(score_mod, "score_mod", True, score_buffers, device)
        buffer_slots = slots.of_buffers(gm, "score", 5)
        for name, grad in (("score_mod", False), ("score_grad", True)):
            gen = Gen(gm, "score_mod", True, buffer_slots, slots.constant, grad)
            out = gen.run()
            value = f"tl.broadcast_to(tl.cast({out.expr}, tl.float32), score.shape)"
            deriv = f"tl.broadcast_to(tl.cast({out.d or 'tl.full([], 0.0, tl.float32)'}, tl.float32), score.shape)"
            src.append(_function(name, "score, b, h, q_idx, kv_idx", gen, f"{value}, {deriv}" if grad else value))
            names.append(name)
    module = _load("".join(src))
    get = lambda n: getattr(module, n) if n in names else None  # noqa: E731
    return KernelMods(get("mask_mod"), get("score_mod"), get("score_grad"), tuple(slots.plan))


def cache_dir() -> str:
    root = os.environ.get("CP_COMPILE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cp_compile")
    return os.path.join(root, "triton_mods")


def _write(folder: str, name: str, source: str) -> str:
    """``folder/name.py`` holding ``source`` (written atomically unless already there)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + ".py")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


def _load(source: str) -> Any:
    """Write ``source`` under :func:`cache_dir` (named by its hash, written atomically) and import it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    name = f"cp_compile_mods_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        path = _write(cache_dir(), name, source)
    except OSError:  # a read-only home: the system's temporary directory
        path = _write(os.path.join(tempfile.gettempdir(), f"cp_compile_{os.getuid()}", "triton_mods"), name, source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a generation bug: name the file to look at
        del sys.modules[name]
        raise ModError(f"cp_compile: the Triton source generated for the mods ({path}) does not import: {e}. "
                       f"{FIX}, and report the mod.") from e
    return module
