"""Local block kernels and the (out, lse) merge, against float64 math on the full block.

Single process: these are the building blocks the ring calls; the ring itself is
tested across real processes in test_ring_exact.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from cp_compile.kernels import get_kernel
from cp_compile.ring.merge import empty_partial, merge_
from checks import rel


def _inputs(b, h, h_kv, lq, lk, d, dtype, seed=0, mag=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64) * mag
    k = torch.randn(b, h_kv, lk, d, generator=g, dtype=torch.float64) * mag
    v = torch.randn(b, h_kv, lk, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, do)]


def _math_fp64(q, k, v, do, causal, scale):
    """Autograd through explicit fp64 softmax attention: (out, lse, dq, dk, dv)."""
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vv
    out.backward(do.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


CASES = [
    # (b, h, h_kv, lq, lk, d, causal)
    (1, 4, 4, 16, 16, 24, True),
    (2, 4, 2, 16, 32, 80, False),
    (1, 4, 1, 33, 33, 64, True),
    (2, 2, 2, 7, 19, 16, False),
]


@pytest.mark.parametrize("name", ["aten", "reference"])
@pytest.mark.parametrize("case", CASES)
def test_block_kernel_fp32_matches_fp64_math(name, case):
    b, h, h_kv, lq, lk, d, causal = case
    q, k, v, do = _inputs(b, h, h_kv, lq, lk, d, torch.float32)
    scale = 1 / math.sqrt(d)
    kern = get_kernel(name, q.device, q.dtype)
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale)
    ref_out, ref_lse, dq_r, dk_r, dv_r = _math_fp64(q, k, v, do, causal, scale)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert lse.dtype == torch.float32
    assert rel(out, ref_out) < 1e-5 and rel(lse, ref_lse) < 1e-5
    # Backward with the (here: only) block's own out/lse = the global ones.
    dq, dk, dv = kern.backward(do, q, k, v, out.to(q.dtype), lse, causal=causal, scale=scale)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["aten", "reference"])
def test_block_kernel_large_logits_do_not_overflow(name):
    # |q.k| * scale ~ 1e3: a naive exp() overflows fp32 at ~88.
    q, k, v, do = _inputs(1, 2, 2, 16, 16, 16, torch.float32, mag=12.0)
    scale = 1 / math.sqrt(16)
    out, lse = get_kernel(name, q.device, q.dtype).forward(q, k, v, causal=True, scale=scale)
    ref_out, ref_lse, *_ = _math_fp64(q, k, v, do, True, scale)
    assert ref_lse.abs().max() > 300  # the case really is extreme
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel(out, ref_out) < 1e-4 and rel(lse, ref_lse) < 1e-5


def test_merge_of_split_keys_equals_full_attention():
    """Associative, order-free merge: any split of the keys gives the full result."""
    q, k, v, do = _inputs(2, 4, 2, 12, 40, 24, torch.float32)
    kern = get_kernel("reference", q.device, q.dtype)
    full_out, full_lse = kern.forward(q.double(), k.double(), v.double(), causal=False, scale=0.3)
    for cuts in ([0, 40], [0, 7, 40], [0, 1, 13, 14, 40]):
        acc_out, acc_lse = empty_partial(q)
        blocks = list(zip(cuts[:-1], cuts[1:]))
        for lo, hi in reversed(blocks):  # arrival order does not matter
            o, lse = kern.forward(q, k[:, :, lo:hi], v[:, :, lo:hi], causal=False, scale=0.3)
            merge_(acc_out, acc_lse, o, lse)
        assert rel(acc_out, full_out) < 1e-6 and rel(acc_lse, full_lse) < 1e-6


def test_merge_rows_without_keys_stay_zero_not_nan():
    q = torch.randn(1, 2, 6, 8)
    acc_out, acc_lse = empty_partial(q)
    # A partial where rows 0-2 saw no key (lse -inf, out 0) and rows 3-5 did.
    part_out = torch.zeros(1, 2, 6, 8)
    part_out[:, :, 3:] = 1.5
    part_lse = torch.full((1, 2, 6), float("-inf"))
    part_lse[:, :, 3:] = 0.25
    merge_(acc_out, acc_lse, part_out, part_lse)
    merge_(acc_out, acc_lse, torch.zeros_like(part_out), torch.full_like(part_lse, float("-inf")))
    assert not torch.isnan(acc_out).any() and not torch.isnan(acc_lse).any()
    assert torch.equal(acc_out[:, :, :3], torch.zeros(1, 2, 3, 8))
    assert torch.isneginf(acc_lse[:, :, :3]).all()
    assert torch.allclose(acc_out[:, :, 3:], torch.full((1, 2, 3, 8), 1.5))
    assert torch.allclose(acc_lse[:, :, 3:], torch.full((1, 2, 3), 0.25))


def test_reference_kernel_fully_masked_rows_give_zero_and_neg_inf():
    # The reference kernel is also used on arbitrary rectangles in tests: a row with
    # every key masked must give out 0 and lse -inf (never NaN).
    q, k, v, do = _inputs(1, 1, 1, 4, 4, 8, torch.float32)
    kern = get_kernel("reference", q.device, q.dtype)
    out, lse = kern.forward(q, k[:, :, :0], v[:, :, :0], causal=False, scale=1.0)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_unsupported_kernel_dtype_names_the_fix():
    q = torch.zeros(1, 1, 4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="kernel='reference'"):
        get_kernel("aten", q.device, q.dtype)
    with pytest.raises(ValueError, match="register_kernel"):
        get_kernel("no-such-kernel", q.device, torch.float32)


@pytest.mark.parametrize("name", ["aten", "reference", "triton"])
def test_builtin_kernels_provide_every_protocol_member(name):
    """The BlockKernel protocol lists everything the ring reads or calls; each built-in kernel
    has all of it (a StepKernel also the step methods), with the documented types."""
    import typing

    from cp_compile.kernels import _REGISTRY, _load_triton
    from cp_compile.kernels.base import BlockKernel, StepKernel

    if name == "triton":
        pytest.importorskip("triton")
        _load_triton()
    kernel = _REGISTRY[name]
    protocol = StepKernel if kernel.fuses_merge else BlockKernel
    members = set(typing.get_type_hints(protocol)) | {m for m in vars(protocol) if not m.startswith("_")}
    for cls in protocol.__mro__:
        if cls not in (object, typing.Protocol, typing.Generic):
            members |= {m for m in vars(cls) if not m.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    missing = sorted(m for m in members if not hasattr(kernel, m))
    assert not missing, f"kernel {name!r} lacks {missing}"
    assert isinstance(kernel.supports_masks, bool) and isinstance(kernel.fuses_merge, bool)
    assert "Fix" in kernel.unsupported_reason(torch.device("cpu"), torch.int32)
