"""Triton ring-attention kernels: fp32 merge inside the kernel, masks by global position.

Unlike the block kernels (:mod:`cp_compile.kernels.base`), which return a per-step
``(out, lse)`` that the ring merges afterwards, these kernels carry the ring's
running softmax state (fp32 ``acc``, ``m``, ``l``) across steps and fold each
visiting block into it inside the kernel (:mod:`.fwd`), and accumulate dQ/dK/dV in
fp32 buffers in place (:mod:`.bwd`). Masks come from the global positions of the
query and key rows (and, for packed documents, from per-row document ids), so one
kernel serves every layout, padding included, and tiles with no visible pair are
skipped. FlexAttention ``mask_mod`` / ``score_mod`` are translated to Triton functions
that the kernels call on each tile (:mod:`.mods`).

The ring loops use the step API (:class:`cp_compile.kernels.base.StepKernel`); the
plain ``forward``/``backward`` of the block-kernel interface are provided too (one
step over local positions), so the kernel also works wherever a block kernel is
expected.

Runs on CUDA (fp16, bf16, fp32; fp32 dots in IEEE precision, not TF32), and on CPU
only under ``TRITON_INTERPRET=1`` (tests). Head dims up to 256; any S_q, S_k; GQA.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import bwd, fwd
from .configs import INTERPRET, Tiles
from .mods import kernel_mods

Tensor = torch.Tensor
State = Tuple[Tensor, Tensor, Tensor]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _positions(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, dtype=torch.int32, device=device)


class TritonKernel:
    """The ``"triton"`` kernel (see the module docstring). ``tiles`` fixes the tile sizes
    (tests, benchmarks); by default the GPU autotunes and the interpreter uses 32 x 32."""

    name = "triton"
    fuses_merge = True
    supports_masks = False  # positions (causal, window, kv_limit) only; explicit masks: kernel='reference'
    supports_doc_ids = True  # forward_step / backward_step take q_doc= / k_doc= (packed documents)
    supports_mods = True  # mask_mod / score_mod translated to Triton (.mods); untranslatable ones are refused
    self_check_devices = ("cuda",)  # never run on a GPU by CI: checked on first use per case (kernels/self_check.py)

    def __init__(self, tiles: Optional[Tiles] = None) -> None:
        self.tiles = tiles

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        if dtype not in DTYPES:
            return False
        return device.type == "cuda" or (device.type == "cpu" and INTERPRET)

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype) -> str:
        """Why :meth:`supports` said no, and the fix."""
        if dtype not in DTYPES:
            return (f"the Triton kernels take float16, bfloat16 or float32, not {dtype}. "
                    "Fix: cast q/k/v, or use kernel='aten' (CPU float64) or 'reference'.")
        return (f"the Triton kernels run on CUDA (or on CPU under TRITON_INTERPRET=1, for tests), "
                f"not on {device.type}. Fix: use kernel='aten' on CPU.")

    # ---- step API: what the ring loops call --------------------------------------
    def new_state(self, q: Tensor) -> State:
        _check_head_dim(q)
        return fwd.new_state(q)

    def forward_step(self, q: Tensor, k: Tensor, v: Tensor, state: State, q_pos: Tensor, k_pos: Tensor, *,
                     causal: bool, scale: float, kv_limit: int = fwd.NO_LIMIT, window: int = fwd.NO_LIMIT,
                     counter: Optional[Tensor] = None, q_doc: Optional[Tensor] = None,
                     k_doc: Optional[Tensor] = None, mods: Any = None) -> None:
        """Fold one visiting block into ``state`` (:func:`.fwd.forward_step`); ``q_doc``/``k_doc``
        (B|1, S) int32: key j is visible to query i only if their document ids are equal; ``mods``:
        FlexAttention mask_mod / score_mod with their buffers (:class:`cp_compile.ring.mods.Mods`)."""
        fwd.forward_step(q, k, v, state, q_pos, k_pos, causal=causal, scale=scale, kv_limit=kv_limit,
                         window=window, counter=counter, tiles=self.tiles, q_doc=q_doc, k_doc=k_doc, mods=mods)

    def check_mods(self, mods: Any, device: torch.device) -> None:
        """Translate ``mods`` to Triton now (cached), so that a mod outside the translated op set is refused
        before the ring starts: a ValueError naming the op and the fix (:mod:`.mods`)."""
        kernel_mods(mods, device)

    def finalize(self, state: State, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        return fwd.finalize(state, dtype)

    def delta(self, dout: Tensor, out: Tensor) -> Tensor:
        return bwd.delta(dout, out)

    def backward_step(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dlt: Tensor,
                      grads: State, q_pos: Tensor, k_pos: Tensor, *, causal: bool, scale: float,
                      kv_limit: int = fwd.NO_LIMIT, window: int = fwd.NO_LIMIT,
                      counter: Optional[Tensor] = None, q_doc: Optional[Tensor] = None,
                      k_doc: Optional[Tensor] = None, mods: Any = None) -> None:
        """Add one visiting block's gradients into ``grads`` (:func:`.bwd.backward_step`); documents and
        mods as in :meth:`forward_step`."""
        bwd.backward_step(dout, q, k, v, lse, dlt, grads, q_pos, k_pos, causal=causal, scale=scale,
                          kv_limit=kv_limit, window=window, counter=counter, tiles=self.tiles,
                          q_doc=q_doc, k_doc=k_doc, mods=mods)

    # ---- block-kernel API: one step over local positions --------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
        state = self.new_state(q)
        self.forward_step(q, k, v, state, _positions(q.shape[2], q.device), _positions(k.shape[2], k.device),
                          causal=causal, scale=scale)
        return self.finalize(state, q.dtype)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                 causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        grads = zero_grads(q, k)
        self.backward_step(dout, q, k, v, lse, self.delta(dout, out), grads,
                           _positions(q.shape[2], q.device), _positions(k.shape[2], k.device),
                           causal=causal, scale=scale)
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)


def zero_grads(q: Tensor, k: Tensor) -> State:
    """fp32 zero accumulators (dq like q, dk and dv like k)."""
    z = lambda t: torch.zeros(t.shape, dtype=torch.float32, device=t.device)  # noqa: E731
    return z(q), z(k), z(k)


def _check_head_dim(q: Tensor) -> None:
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"cp_compile: the Triton kernels support head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}. "
            "Fix: use kernel='aten'."
        )


__all__ = ["TritonKernel", "Tiles", "zero_grads"]
