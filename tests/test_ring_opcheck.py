"""torch.library.opcheck on the ring custom ops: schema, fake (shapes *and* strides),
autograd registration and AOT dispatch all agree with the real implementation.

Runs on 2 real ranks (the ops communicate); every rank makes the same calls in the
same order, so the collectives inside the repeated op calls match up. Also with a score_mod
whose buffer requires grad (the forward's autograd registration with the buffer's gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp_compile  # noqa: F401  (registers the ops)

# opcheck's "test_schema" runs the op under a mode that checks for mutation/aliasing.
_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _inputs(transposed: bool):
    g = torch.Generator().manual_seed(dist.get_rank())
    if transposed:  # (B, S, H, D) activations viewed as (B, H, S, D): non-contiguous
        q = torch.randn(2, 8, 4, 16, generator=g).transpose(1, 2)
        k = torch.randn(2, 8, 2, 16, generator=g).transpose(1, 2)
        v = torch.randn(2, 8, 2, 16, generator=g).transpose(1, 2)
    else:
        q = torch.randn(2, 4, 8, 16, generator=g)
        k = torch.randn(2, 2, 8, 16, generator=g)
        v = torch.randn(2, 2, 8, 16, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def _opcheck_on_rank():
    name = dist.group.WORLD.group_name
    failures = {}
    for transposed in (False, True):
        for causal, lb in ((True, "zigzag"), (True, "striped"), (False, "contiguous")):
            q, k, v = _inputs(transposed)
            args = (q, k, v, causal, 0.25, name, lb, "p2p", "aten")
            res = torch.library.opcheck(torch.ops.cp_compile.ring_attention_fwd.default, args, test_utils=_TESTS)
            bad = {t: r for t, r in res.items() if r != "SUCCESS"}
            detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            out, lse = torch.ops.cp_compile.ring_attention_fwd(*detached)
            bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, causal, 0.25, name, lb,
                        "p2p", "aten")
            res_b = torch.library.opcheck(
                torch.ops.cp_compile.ring_attention_bwd.default, bwd_args, test_utils=("test_schema", "test_faketensor")
            )
            bad.update({f"bwd:{t}": r for t, r in res_b.items() if r != "SUCCESS"})
            if bad:
                failures[(transposed, causal, lb)] = {t: str(r) for t, r in bad.items()}
    return failures


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx)


def _opcheck_learned_on_rank():
    """A score_mod whose buffer requires grad (learned ALiBi slopes): the forward's schema, fake, autograd
    registration and AOT dispatch (which runs the backward for real: gradients of q, k, v AND the slopes).
    The backward op itself is not opchecked with a score_mod, learned buffers or not: it takes torch.func.vjp
    through the (vmapped) mod, whose functorch wrappers opcheck's modes cannot read ("Cannot access storage
    of TensorWrapper"); its fake's Tensor[] output is compared with the real one in
    tests/test_ring_learned_bias.py."""
    from cp_compile.ring.mods import register_mods

    name, key = dist.group.WORLD.group_name, register_mods(score_mod=_alibi)
    q, k, v = _inputs(False)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    args = (q, k, v, True, 0.25, name, "zigzag", "p2p", "aten")
    kw = {"mods": key, "score_buffers": [slopes]}
    res = torch.library.opcheck(torch.ops.cp_compile.ring_attention_fwd.default, args, kw, test_utils=_TESTS)
    return {t: str(r) for t, r in res.items() if r != "SUCCESS"}


@pytest.mark.slow
def test_ring_ops_with_a_learned_score_buffer_pass_opcheck(ranks):
    for rank, failures in enumerate(ranks.run(2, _opcheck_learned_on_rank)):
        assert failures == {}, f"rank {rank}: {failures}"


@pytest.mark.slow
def test_ring_custom_ops_pass_opcheck(ranks):
    for rank, failures in enumerate(ranks.run(2, _opcheck_on_rank)):
        assert failures == {}, f"rank {rank}: {failures}"
