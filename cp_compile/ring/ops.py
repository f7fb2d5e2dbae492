"""``torch.library`` custom ops for ring attention, so compiled graphs keep it whole.

``cp_compile::ring_attention_fwd(q, k, v, ...) -> (out, lse)`` and
``cp_compile::ring_attention_bwd(dout, q, k, v, out, lse, ..., score_grads=None) -> (dq, dk, dv,
d_score_buffers)`` are opaque to Dynamo/AOTAutograd (no graph break, no tracing into the
communication), have fake implementations for shape propagation, and are linked by
``register_autograd``. The process group travels as its registered name, since
custom ops take only tensors and plain values; ``timeout`` (seconds, ``-1``: the
process group's own) bounds every wait of the ring (:mod:`.faults`). The first
forward call with given arguments checks that every rank passed the same ones
(:mod:`.agree`). Under ``torch.autocast`` the forward casts q, k, v as autocast casts SDPA's
(:mod:`.autocast`).

Learned score buffers: ``score_buffers`` may require grad (a relative-position bias table, ALiBi
slopes). The backward op then gets ``score_grads`` (one bool per score buffer) and returns, as a
``Tensor[]``, the gradient of each flagged buffer: this rank's SHARE, from its own queries'
rectangles against every key block the ring visits (:mod:`.loops`, explicit scores). The shares
sum over the CP group to the gradient; the caller sums them (the ``ring_cp`` backend all-reduces a
parameter's gradient in the backward graph; users of :func:`cp_compile.ring_attention` all-reduce
parameter gradients over the CP group as for every other parameter). mask_buffers stay constants.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..group import group_by_name
from ..kernels import get_kernel
from ..kernels.self_check import checked_kernel
from ..sequence import check_table
from . import autocast
from .agree import check_device, check_same_call, metadata
from .faults import RingGroup
from .loops import ring_backward, ring_forward
from .masking import MaskSpec
from .mods import lookup

Tensor = torch.Tensor


def _spec(window: int, attn_mask: Optional[Tensor], doc_ids: Optional[Tensor], mods: str,
          mask_buffers: Optional[Sequence[Tensor]], score_buffers: Optional[Sequence[Tensor]],
          learned: Sequence[int] = ()) -> MaskSpec:
    """The op's masking arguments as one :class:`.masking.MaskSpec` (mods looked up by key; ``learned``: the
    indices of the score buffers whose gradient the backward computes)."""
    entry = lookup(mods).with_buffers(mask_buffers, score_buffers, learned) if mods else None
    return MaskSpec(window, attn_mask, doc_ids, entry)


def _table(positions: Optional[Tensor], world_size: int, c: int) -> Optional[Tensor]:
    """The positions table checked (the same on every rank by then: :mod:`.agree` compares fingerprints)."""
    return None if positions is None else check_table(positions, world_size, world_size * c)


def _run_options(group_name: str, kernel: str, q: Tensor, timeout: float, phase: str,
                 form: Tuple[bool, int, bool]) -> dict:
    """The group (with its wait limit and phase, see :class:`.faults.RingGroup`) and the kernel, checked
    on first use for this call's ``form`` (causal, window, documents) where it checks itself
    (:mod:`cp_compile.kernels.self_check`: a failed "auto" choice falls back, warned)."""
    g = group_by_name(group_name)
    group = RingGroup(g.pg, g.rank, g.size, timeout=timeout if timeout > 0 else None, phase=phase)
    check_device(group, q.device)
    chosen = checked_kernel(kernel, get_kernel(kernel, q.device, q.dtype), q, *form, group)
    return {"group": group, "kernel": chosen}


# Explicit schemas: ``Optional[List[Tensor]]`` (``Tensor[]?``) is not inferred from annotations.
_OPTIONAL = ("SymInt valid_len=-1, float timeout=-1., int window=-1, Tensor? attn_mask=None, Tensor? doc_ids=None, "
             "str mods=\"\", Tensor[]? mask_buffers=None, Tensor[]? score_buffers=None, Tensor? positions=None")
_FWD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float scale, str group_name, str load_balance, str rotate, "
               f"str kernel, {_OPTIONAL}) -> (Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float scale, "
               f"str group_name, str load_balance, str rotate, str kernel, {_OPTIONAL}, bool[]? score_grads=None) "
               "-> (Tensor, Tensor, Tensor, Tensor[])")


@torch.library.custom_op("cp_compile::ring_attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def ring_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
    group_name: str, load_balance: str, rotate: str, kernel: str, valid_len: int = -1, timeout: float = -1.0,
    window: int = -1, attn_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None, mods: str = "",
    mask_buffers: Optional[List[Tensor]] = None, score_buffers: Optional[List[Tensor]] = None,
    positions: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact attention of local q over the CP group's whole K/V: (out, lse (B, H, c) fp32).

    ``valid_len`` >= 0: global positions from there on are padding (never attended).
    ``timeout`` > 0: seconds each ring wait may take (else the process group's timeout).
    ``window`` > 0 (causal): sliding window; ``attn_mask``: this rank's rows of an
    additive float32 mask, (B|1, H|1, c, N·c) (see :mod:`.masking`). ``doc_ids``: (B|1, N·c)
    integer document ids over the whole sequence (:mod:`.docs`); ``mods``: a key from
    :func:`.mods.register_mods`, whose mask_mod / score_mod read ``mask_buffers`` /
    ``score_buffers`` (whole tensors; score buffers may require grad, see the module docstring).
    ``positions``: an (N, c) int64 table, row r = rank r's sorted global positions (the same whole
    tensor on every rank), in place of ``load_balance`` (:func:`cp_compile.sequence.check_table`)."""
    check_one_dtype(q, k, v)
    opts = _run_options(group_name, kernel, q, timeout, "forward", (causal, window, doc_ids is not None))
    q, k, v = _dense(q), _dense(k), _dense(v)
    meta = metadata(q, k, v, causal, scale, load_balance, rotate, opts["kernel"].name, valid_len, window,
                    attn_mask, doc_ids=doc_ids, mods=mods, mask_buffers=mask_buffers, score_buffers=score_buffers,
                    positions=positions)
    check_same_call(meta, opts["group"], q.device, opts["kernel"].name)  # then every rank checks the same table
    return ring_forward(
        q, k, v, causal=causal, scale=scale, load_balance=load_balance, rotate=rotate, valid_len=valid_len,
        spec=_spec(window, attn_mask, doc_ids, mods, mask_buffers, score_buffers),
        positions=_table(positions, opts["group"].size, q.shape[2]), **opts
    )


def check_one_dtype(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise if q, k, v (as the op gets them: after the autocast rule) differ in dtype, as SDPA does."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"cp_compile.ring_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}), which "
            "F.scaled_dot_product_attention refuses too. Fix: cast q, k, v to one dtype, or run under "
            "torch.autocast (the ring casts them as autocast casts SDPA's).")


def _dense(t: Tensor) -> Tensor:
    """``t`` with its head dim innermost (unit last stride), copied only if it is not: the CPU flash
    kernel gives wrong numbers, silently, for a view whose head dim is not the innermost one (q from
    ``x.view(B, H, D, S).permute(0, 1, 3, 2)``: Hugging Face SqueezeBERT's (B, C, S) layout). The
    usual ``x.view(B, S, H, D).transpose(1, 2)`` (unit last stride, not contiguous) is read as it is:
    a row-major copy of each of q, k, v (and dout) would be (B, H, c, D) more at the backward's peak
    (benchmark 1's T5 block at S = 8k, N = 4: per-rank peak 53.7 -> 47.5 MiB without them)."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


@ring_attention_fwd.register_fake
def _(q, k, v, causal, scale, group_name, load_balance, rotate, kernel, valid_len=-1, timeout=-1.0, window=-1,
      attn_mask=None, doc_ids=None, mods="", mask_buffers=None, score_buffers=None, positions=None):
    # The real op returns fresh contiguous tensors whatever the input strides.
    check_one_dtype(q, k, v)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("cp_compile::ring_attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def ring_attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
    scale: float, group_name: str, load_balance: str, rotate: str, kernel: str, valid_len: int = -1,
    timeout: float = -1.0, window: int = -1, attn_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
    mods: str = "", mask_buffers: Optional[List[Tensor]] = None, score_buffers: Optional[List[Tensor]] = None,
    positions: Optional[Tensor] = None, score_grads: Optional[List[bool]] = None,
) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
    """Gradients of the local shards: (dq, dk, dv), dK/dV summed over every rank's queries, and the
    gradients of the score buffers flagged in ``score_grads`` (this rank's shares, in the buffers' order)."""
    opts = _run_options(group_name, kernel, q, timeout, "backward", (causal, window, doc_ids is not None))
    dout, q, k, v, out = (_dense(t) for t in (dout, q, k, v, out))
    spec = _spec(window, attn_mask, doc_ids, mods, mask_buffers, score_buffers,
                 _learned(mods, score_buffers, score_grads))
    dq, dk, dv = ring_backward(
        dout, q, k, v, out, lse, causal=causal, scale=scale, load_balance=load_balance, rotate=rotate,
        valid_len=valid_len, spec=spec, positions=_table(positions, opts["group"].size, q.shape[2]), **opts,
    )
    return dq, dk, dv, spec.mods.buffer_grads() if spec.mods is not None else []


def _learned(mods: str, score_buffers: Optional[Sequence[Tensor]], score_grads: Optional[Sequence[bool]]) -> List[int]:
    """The indices of the score buffers whose gradient is asked for, after checking the flags."""
    if not score_grads or not any(score_grads):
        return []
    n = len(score_buffers or ())
    if len(score_grads) != n or not mods:
        raise ValueError(f"cp_compile.ring_attention_bwd: score_grads has {len(score_grads)} flags for {n} "
                         f"score_buffers{'' if mods else ' and no mods'}. Fix: one flag per score buffer.")
    floating = [i for i, f in enumerate(score_grads) if f]
    if any(not score_buffers[i].dtype.is_floating_point for i in floating):
        raise ValueError("cp_compile.ring_attention_bwd: a gradient is asked of an integer score buffer. "
                         "Fix: flag only floating-point buffers.")
    return floating


@ring_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, scale, group_name, load_balance, rotate, kernel, valid_len=-1, timeout=-1.0,
      window=-1, attn_mask=None, doc_ids=None, mods="", mask_buffers=None, score_buffers=None, positions=None,
      score_grads=None):
    d_buffers = [score_buffers[i].new_empty(score_buffers[i].shape) for i in _learned(mods, score_buffers, score_grads)]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_buffers  # contiguous, like the real op


_OPTION_NAMES = ("causal", "scale", "group_name", "load_balance", "rotate", "kernel", "valid_len", "timeout",
                 "window")  # then the tensor arguments below, and mods between them
_DEFAULTS = (-1, -1.0, -1, None, None, "", None, None, None)  # valid_len .. positions


def _refuse_learned_masks(buffers: Sequence[Tensor]) -> None:
    if any(t.requires_grad for t in buffers):
        raise ValueError(
            "cp_compile.ring_attention: a mask_buffers tensor requires grad; a mask_mod's result is boolean, so "
            "its buffers get no gradient. Fix: pass buffer.detach(), or read a learned tensor in the score_mod "
            "(score_buffers may require grad)."
        )


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    q, k, v, *options = inputs
    out, lse = output
    n_plain = len(_OPTION_NAMES)
    options = list(options) + list(_DEFAULTS[len(options) - 6:])  # the defaults of arguments not passed
    ctx.n_inputs = _n_inputs(options)
    attn_mask, doc_ids, mods, mask_buffers, score_buffers, positions = options[n_plain:n_plain + 6]
    ctx.list_grads = [None if b is None else [None] * len(b) for b in (mask_buffers, score_buffers)]
    mask_buffers, score_buffers = list(mask_buffers or ()), list(score_buffers or ())
    _refuse_learned_masks(mask_buffers)
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, doc_ids, positions, *mask_buffers, *score_buffers)
    ctx.options = dict(zip(_OPTION_NAMES, options))
    ctx.mods, ctx.n_mask_buffers = mods, len(mask_buffers)
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, dout: Tensor, _dlse: Any):
    q, k, v, out, lse, attn_mask, doc_ids, positions, *buffers = ctx.saved_tensors
    o, n = ctx.options, ctx.n_mask_buffers
    flags = _score_flags(ctx, len(buffers) - n)
    dq, dk, dv, d_learned = ring_attention_bwd(
        _dense(dout), q, k, v, out, lse, o["causal"], o["scale"], o["group_name"],
        o["load_balance"], o["rotate"], o["kernel"], o["valid_len"], o["timeout"], o["window"], attn_mask,
        doc_ids, ctx.mods, buffers[:n] or None, buffers[n:] or None, positions, flags,
    )
    mask_grads, score_grads = ctx.list_grads
    if flags is not None:  # the learned score buffers' gradients in their places, None for the others
        it = iter(d_learned)
        score_grads = [next(it) if f else None for f in flags]
    # No gradient for the other inputs: None each, [None] * n for a list of n buffers, and one entry per
    # input the dispatcher handed over: it drops trailing arguments equal to their defaults.
    grads = (dq, dk, dv, *(None,) * (len(_OPTION_NAMES) + 3), mask_grads, score_grads, None)  # the last: positions
    return grads[:ctx.n_inputs]


_SCORE_BUFFERS = 3 + len(_OPTION_NAMES) + 4  # the input index of score_buffers (after attn_mask .. mask_buffers)


def _score_flags(ctx: Any, n_score: int) -> Optional[List[bool]]:
    """One flag per score buffer: whether autograd wants its gradient (None: none does)."""
    if n_score == 0 or ctx.n_inputs <= _SCORE_BUFFERS:
        return None
    need = ctx.needs_input_grad[_SCORE_BUFFERS]
    flags = [bool(f) for f in need] if isinstance(need, (list, tuple)) else [bool(need)] * n_score
    return flags if any(flags) else None


def _n_inputs(options: List[Any]) -> int:
    """How many inputs the autograd function sees: trailing defaulted arguments do not count."""
    n = len(options)
    while n > len(options) - len(_DEFAULTS):
        value, default = options[n - 1], _DEFAULTS[n - 1 - (len(options) - len(_DEFAULTS))]
        if not (value is None if default is None else (not isinstance(value, torch.Tensor) and value == default)):
            break
        n -= 1
    return 3 + n


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
autocast.register(torch.ops.cp_compile.ring_attention_fwd.default)  # SDPA's autocast rule

from . import table_op as _table_op  # noqa: E402,F401  (registers cp_compile::document_table)
