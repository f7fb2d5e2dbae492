"""Kernels check themselves on first use where CI never runs them (cp_compile/kernels/self_check.py).

* the check itself: the real Triton kernels (under the interpreter) pass it in every dtype and mask
  form; a kernel that is 5% off, or that raises, fails it, naming what;
* the mechanism, on 2 ranks, with deliberately wrong stand-ins checked on the CPU: a wrong kernel that
  ``kernel="auto"`` picks is warned once per case and replaced by aten (the ring is then exact against
  one process); asked for by name, it raises naming the case; wrong on one rank only, every rank falls
  back (one agreed verdict: no rank runs a different ring);
* :func:`cp_compile.reset_warnings` forgets the verdicts (a test sees the check again).
"""

from __future__ import annotations

import logging

import pytest
import torch

from cp_compile.kernels import self_check
from cp_compile.kernels.aten import AtenKernel
from checks import rel

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMS = [(False, False, False), (True, False, False), (True, True, False), (False, False, True), (True, True, True)]


class WrongKernel(AtenKernel):
    """aten, its outputs 5% too large (on rank ``only`` if given), checked on the CPU."""

    name = "wrong_standin"
    self_check_devices = ("cpu",)

    def __init__(self, only: int = -1) -> None:
        self.only = only

    def forward(self, q, k, v, *, causal, scale, mask=None):
        import torch.distributed as dist

        out, lse = super().forward(q, k, v, causal=causal, scale=scale, mask=mask)
        wrong = self.only < 0 or (dist.is_initialized() and dist.get_rank() == self.only)
        return (out * 1.05 if wrong else out), lse


class RaisingKernel(AtenKernel):
    name = "raising_standin"
    self_check_devices = ("cpu",)

    def forward(self, q, k, v, *, causal, scale, mask=None):
        raise RuntimeError("no kernel image is available for execution on the device")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_triton_kernels_pass_their_own_self_check_under_the_interpreter(dtype) -> None:
    from cp_compile.kernels.triton import TritonKernel

    for causal, window, docs in FORMS:
        for head_dim in (16, 64):
            case = self_check.Case("triton", "cpu", dtype, head_dim, causal, window, docs)
            assert self_check.verdict(TritonKernel(), case) is None, case.describe()


def test_a_kernel_that_is_off_or_raises_fails_the_check_naming_what() -> None:
    case = self_check.Case("x", "cpu", torch.float32, 16, True, False, False)
    wrong = self_check.verdict(WrongKernel(), case)
    assert wrong is not None and wrong.startswith("out differs from the math by 5.00e-02"), wrong
    raised = self_check.verdict(RaisingKernel(), case)
    assert raised == "RuntimeError: no kernel image is available for execution on the device", raised
    assert self_check.verdict(AtenKernel(), case) is None


def _ring_with(kernel_name: str, stand_in: str, only: int = -1) -> dict:
    """On a rank: the causal ring (S = 32, window 8) with ``kernel_name`` while "auto" picks the stand-in,
    against SDPA on the whole sequence; what was warned, what was raised."""
    import cp_compile
    import cp_compile.kernels as kernels

    made = WrongKernel(only) if stand_in == "wrong_standin" else RaisingKernel()
    kernels.register_kernel(made, replace=True)
    saved, kernels.auto_kernel_name = kernels.auto_kernel_name, lambda device: stand_in
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("cp_compile").addHandler(handler)
    try:
        return _compare(kernel_name, records)
    except RuntimeError as e:
        return {"raised": str(e)}
    finally:
        kernels.auto_kernel_name = saved
        logging.getLogger("cp_compile").removeHandler(handler)
        cp_compile.reset_warnings()


def _compare(kernel_name: str, records: list) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    import cp_compile

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [cp_compile.shard(t, 2).requires_grad_() for t in (q, k, v)]
    out = cp_compile.ring_attention(*local, causal=True, window=8, kernel=kernel_name)
    out.square().sum().backward()
    allowed = torch.ones(32, 32, dtype=torch.bool).tril() & ~torch.ones(32, 32, dtype=torch.bool).tril(-8)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=allowed)
    want.square().sum().backward()
    errs = [rel(out.detach(), cp_compile.shard(want.detach(), 2))]
    errs += [rel(t.grad, cp_compile.shard(r.grad, 2)) for t, r in zip(local, ref)]
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING and "self-check" in r.getMessage()]
    return {"errors": errs, "warned": warned, "rank": rank, "world": world}


@pytest.mark.multirank
def test_a_wrong_kernel_picked_by_auto_is_warned_and_replaced_exactly(ranks) -> None:
    for r in ranks.run(2, _ring_with, "auto", "wrong_standin", timeout=120):
        assert max(r["errors"]) <= 1e-5, r  # the stand-in is 5% off: the ring ran on aten instead
        [msg] = r["warned"]  # once, for the case (the backward reuses the verdict)
        assert "kernel 'wrong_standin' failed its self-check for (float32, head dim 16, causal+window, on cpu)" \
            in msg and "out differs from the math" in msg and "runs on kernel 'aten'" in msg, msg


@pytest.mark.multirank
def test_a_kernel_that_raises_is_replaced_and_one_asked_for_by_name_is_refused(ranks) -> None:
    for r in ranks.run(2, _ring_with, "auto", "raising_standin", timeout=120):
        assert max(r["errors"]) <= 1e-5 and len(r["warned"]) == 1, r
        assert "RuntimeError: no kernel image is available" in r["warned"][0], r
    for r in ranks.run(2, _ring_with, "wrong_standin", "wrong_standin", timeout=120):
        assert "kernel 'wrong_standin' failed its self-check for (float32, head dim 16, causal+window, on cpu)" \
            in r["raised"] and "Fix: kernel='auto'" in r["raised"], r


@pytest.mark.multirank
def test_a_kernel_wrong_on_one_rank_only_falls_back_on_every_rank(ranks) -> None:
    results = ranks.run(2, _ring_with, "auto", "wrong_standin", 1, timeout=120)
    for r in results:
        assert max(r["errors"]) <= 1e-5 and len(r["warned"]) == 1, r
    assert "failed on another rank" in results[0]["warned"][0], results[0]
    assert "out differs from the math" in results[1]["warned"][0], results[1]


def test_reset_warnings_forgets_the_verdicts() -> None:
    import cp_compile

    calls = []

    class Counted(AtenKernel):
        name = "counted_standin"
        self_check_devices = ("cpu",)

        def forward(self, q, k, v, *, causal, scale, mask=None):
            calls.append(1)
            return super().forward(q, k, v, causal=causal, scale=scale, mask=mask)

    q = torch.randn(1, 2, 8, 16)
    kernel = Counted()
    for _ in range(2):
        assert self_check.checked_kernel("auto", kernel, q, True, -1, False) is kernel
    assert len(calls) == 1, "a verdict is kept for the case"
    cp_compile.reset_warnings()
    self_check.checked_kernel("auto", kernel, q, True, -1, False)
    assert len(calls) == 2, "reset_warnings forgot it"
