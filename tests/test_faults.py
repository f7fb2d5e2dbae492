"""A peer that dies or raises mid-ring: the survivors raise a named error instead of hanging.

A fault breaks the process group for good (gloo closes the connections it timed out
on or that a dead peer reset), so these tests do not use the shared ``ranks`` pools:
each scenario spawns its own gloo group on a fresh port (:func:`run_isolated`) and
tears it down, and later tests are unaffected.

The fault is injected by a stand-in block kernel (the reference kernel, plus a
trigger) that on one rank, at one ring step of the forward, either calls
``os._exit`` (a crashed process: its sockets close) or raises and then lingers
without communicating (a live process that left the ring, as a persistent worker
would). Non-causal attention calls the kernel once per ring step, so the forward's
call index is the ring step.

What the survivors must raise: :class:`RingCommError` naming their rank, the peer
they were waiting for, the ring step, the direction (forward K/V, backward K/V,
backward dK/dV) and the fix (the ``timeout=`` option), and why the wait ended: the
transport failed (a dead peer's connections reset), or the limit in force ran out —
the timeout given to the op, or, without one, the process group's own — which the
message names. No verdict depends on how long anything took: that the ring hands
each wait the op's limit, whole, is checked on fake works and a fake clock
(:func:`test_waits_get_the_op_timeout`); the real runs check which limit fired by the
message; a survivor that hangs instead never answers :func:`run_isolated`, whose
``wait`` is only the guard against a test that hangs forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cp_compile.ring import faults
from distributed import _free_port

FAULT_KERNEL = "test_fault_kernel"
DIRECTIONS = r"\((forward K/V|backward K/V|backward dK/dV)\)"
FIX = "Fix: look for "
TRANSFER_FAILED = "the transfer failed ("  # a transport error ended the wait, not a limit
_STOP = None  # in a worker: the Event the parent sets once the survivors have answered


class FaultKernel:
    """The reference kernel, except on ``rank`` at forward call ``step``: exit or raise."""

    name = FAULT_KERNEL

    def __init__(self, rank: int, step: int, how: str) -> None:
        from cp_compile.kernels.reference import ReferenceKernel

        self.rank, self.step, self.how, self.calls = rank, step, how, 0
        self.inner = ReferenceKernel()

    def supports(self, device, dtype) -> bool:
        return True

    def forward(self, q, k, v, *, causal, scale):
        if dist.get_rank() == self.rank and self.calls == self.step:
            if self.how == "exit":
                os._exit(17)
            raise RuntimeError(f"stand-in kernel failure on rank {self.rank} at ring step {self.step}")
        self.calls += 1
        return self.inner.forward(q, k, v, causal=causal, scale=scale)

    def backward(self, *args, **kwargs):
        return self.inner.backward(*args, **kwargs)


def _ring_with_fault(fault_rank: int, step: int, how: str, timeout, linger: float):
    """On every rank: forward + backward of a non-causal ring with the fault injected.

    Returns (exception type, message), or None if the op succeeded. The faulty rank,
    after raising, lingers without communicating until the others have answered (at
    most ``linger`` s).
    """
    import cp_compile
    from cp_compile.kernels import register_kernel

    register_kernel(FaultKernel(fault_rank, step, how), replace=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, requires_grad=True) for _ in range(3))
    dist.barrier()  # the processes started at different times; the op's timeout is short
    try:
        out = cp_compile.ring_attention(q, k, v, load_balance="contiguous", kernel=FAULT_KERNEL, timeout=timeout)
        out.sum().backward()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = (type(e).__name__, str(e))
        if dist.get_rank() == fault_rank:
            _STOP.wait(linger)
        return result
    return None


def _compiled_with_fault(timeout: float, linger: float):
    """As :func:`_ring_with_fault` (rank 1 raises at its first attention's step 1), through a
    Llama compiled with ``RingCP(timeout=...)``: the backend's timeout reaches the ring ops."""
    import sys

    import cp_compile
    from cp_compile.kernels import register_kernel

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import models

    from checks import explain_record

    register_kernel(FaultKernel(1, 1, "raise"), replace=True)
    model, inputs = models.llama_factory(seq_len=32)
    # explain runs the traced graph as it is (SDPA), never the kernel: the fault's call count is untouched
    explained = explain_record(model, inputs, world_size=dist.get_world_size(), kernel=FAULT_KERNEL)
    backend = cp_compile.RingCP(inner="aot_eager", kernel=FAULT_KERNEL, timeout=timeout)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    dist.barrier()
    try:
        compiled(*inputs).backward()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = (type(e).__name__, str(e))
        # the graph was compiled (and recorded) before its first ring op ran into the fault
        assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
        if dist.get_rank() == 1:
            _STOP.wait(linger)
        return result
    return None


# --------------------------------------------------------------------------- isolated group


def _isolated_worker(rank, world, init_method, pg_timeout, fn, args, results, stop) -> None:
    global _STOP
    os.environ["CP_COMPILE_TEST_WORKER"] = "1"
    _STOP = stop
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        results.put((rank, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - e.g. a failed init
        results.put((rank, ("worker error", f"{type(e).__name__}: {e}")))
    results.close()
    results.join_thread()
    os._exit(0)  # skip teardown: the group is broken on purpose


def run_isolated(world: int, fn, *args, pg_timeout: float = 60.0, wait: float = 120.0) -> dict:
    """Run ``fn(*args)`` on ``world`` fresh processes forming their own gloo group.

    Returns {rank: return value} for the ranks that answered within ``wait`` seconds
    (a rank that died answers nothing); every process is gone when this returns. Once
    ``world - 1`` ranks have answered, the workers' ``_STOP`` event is set.
    """
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_isolated_worker, args=(r, world, init, pg_timeout, fn, args, results, stop),
                         name=f"cp-fault-rank{r}-of{world}") for r in range(world)]
    for p in procs:
        p.start()
    answers: dict = {}
    deadline = time.monotonic() + wait
    try:
        while len(answers) < world and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=0.2)
                answers[rank] = value
                if len(answers) >= world - 1:
                    stop.set()
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        results.cancel_join_thread()
        results.close()
    return answers


def _check_named_error(res, rank: int, peer, limit: str) -> str:
    """``res`` is a survivor's RingCommError naming itself, ``peer``, a step, a direction and the
    fix, and saying why the wait ended: the transfer failed, or no answer within ``limit``
    (the limit in force as the message states it, e.g. "2 s": so it was that limit that fired)."""
    assert res is not None, f"rank {rank}: the ring did not notice the fault"
    typ, msg = res
    assert typ == "RingCommError", (rank, typ, msg)
    assert re.search(DIRECTIONS, msg), msg  # in the ring itself, not the argument check
    assert f"rank {rank} of the CP group gave up at" in msg, msg
    assert re.search(r"(ring step \d+ of \d+|the last hop)", msg), msg
    if peer is not None:
        assert f"rank {peer}" in msg.split(" has most likely")[0], msg
    assert FIX in msg and "timeout=SECONDS" in msg, msg
    assert TRANSFER_FAILED in msg or f"no answer within {limit}. " in msg, (rank, limit, msg)
    return msg


# --------------------------------------------------------------------------- the wait itself


class _FakeWork:
    """A ``dist.Work`` stand-in on a fake clock: records the limit its wait was given, takes
    ``seconds``, then returns ``done`` (gloo's wait returns False or raises on a timeout)."""

    NOT_GIVEN = "no limit given"

    def __init__(self, clock: SimpleNamespace, seconds: float, done=True) -> None:
        self.clock, self.seconds, self.done, self.given = clock, seconds, done, None

    def wait(self, timeout=NOT_GIVEN):
        self.given = timeout
        self.clock.now += self.seconds
        if isinstance(self.done, Exception):
            raise self.done
        return self.done


def test_waits_get_the_op_timeout(monkeypatch):
    """The limit a wait hands the transport, on a fake clock: with ``timeout=2`` the hop's works
    share the whole 2 s (the first gets 2 s, the second what the first left), so the ring
    never gives up early; the work that comes back unfinished is named with "no answer
    within 2 s". Without a timeout the works wait unbounded by the ring (the transport
    enforces the process group's timeout), and a transport timeout is reported as that one."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(faults, "time", SimpleNamespace(monotonic=lambda: clock.now))
    group = faults.RingGroup(None, 0, 2, timeout=2.0, phase="backward")
    works = [_FakeWork(clock, 0.5), _FakeWork(clock, 1.5, done=False)]
    unanswered = r"while receiving the K/V block from rank 1: no answer within 2 s\."
    with pytest.raises(faults.RingCommError, match=unanswered):
        faults.wait_hop(faults.p2p_hop(works, group, "K/V", 1, n_pairs=1))
    assert [w.given for w in works] == [timedelta(seconds=2.0), timedelta(seconds=1.5)]

    group = faults.RingGroup(None, 0, 2, timeout=None, phase="backward")
    works = [_FakeWork(clock, 0.0), _FakeWork(clock, 3.0, done=RuntimeError("Timed out waiting 3000ms for recv"))]
    with pytest.raises(faults.RingCommError, match=r"no answer within the process group's timeout\."):
        faults.wait_hop(faults.p2p_hop(works, group, "dK/dV", 2, n_pairs=1))
    assert [w.given for w in works] == [_FakeWork.NOT_GIVEN] * 2


# --------------------------------------------------------------------------- a faulty peer


@pytest.mark.slow
def test_peer_exits_during_step_1_two_ranks():
    """Rank 1 dies in forward step 1 (the last one): rank 0 finishes its forward, and its
    backward's first K/V hop to rank 1 fails (connection reset, not the 30 s timeout), naming rank 1."""
    answers = run_isolated(2, _ring_with_fault, 1, 1, "exit", 30.0, 0.0)
    assert set(answers) == {0}, answers
    msg = _check_named_error(answers[0], 0, 1, limit="30 s")
    assert "(backward K/V)" in msg and "ring step 1 of 2" in msg and TRANSFER_FAILED in msg, msg


@pytest.mark.slow
def test_peer_exits_during_step_1_four_ranks():
    """Rank 1 dies in forward step 1 of 4: its ring neighbours (0 sends to it, 2 receives
    from it) name it; rank 3, whose neighbours then fail, raises too; nobody hangs (each
    wait ends by a transport failure or the op's 10 s timeout)."""
    answers = run_isolated(4, _ring_with_fault, 1, 1, "exit", 10.0, 0.0)
    assert set(answers) == {0, 2, 3}, answers
    for rank in (0, 2):
        _check_named_error(answers[rank], rank, 1, limit="10 s")
    _check_named_error(answers[3], 3, None, limit="10 s")


@pytest.mark.slow
def test_peer_raises_and_stays_alive_times_out():
    """Rank 1 of 3 raises in forward step 1 and stays alive without communicating: the
    others give up when the op's timeout (2 s) runs out, naming the peer they waited for."""
    timeout, world = 2.0, 3
    answers = run_isolated(world, _ring_with_fault, 1, 1, "raise", timeout, 60.0)
    assert set(answers) == set(range(world)), answers
    typ, msg = answers[1]
    assert typ == "RuntimeError" and "stand-in kernel failure on rank 1" in msg, answers[1]
    for rank in range(world):
        if rank != 1:
            _check_named_error(answers[rank], rank, None, limit="2 s")
    # rank 0 sends to rank 1 at its first backward hop and gets no answer
    assert "no answer within 2 s. " in answers[0][1] and "rank 1" in answers[0][1], answers[0]


@pytest.mark.slow
def test_default_limit_is_the_process_group_timeout():
    """No timeout given: a wait is bounded by the process group's own timeout (here 3 s),
    and the error says so."""
    answers = run_isolated(2, _ring_with_fault, 1, 1, "raise", None, 60.0, pg_timeout=3.0)
    msg = _check_named_error(answers[0], 0, 1, limit="3 s (the process group's timeout)")
    assert "no answer within 3 s (the process group's timeout). " in msg, msg


@pytest.mark.slow
def test_backend_timeout_reaches_the_ring():
    """RingCP(timeout=10): rank 1 raises inside the compiled model's first attention; rank 0
    goes on to the second attention, whose argument check (an all-gather every ring call
    runs, see cp_compile/ring/agree.py) gets no answer: rank 0 gives up when the backend's
    10 s run out (not the process group's 60 s). Each rank compiles on its first call, after
    the barrier, so the limit leaves room for one rank compiling seconds later than the other
    on a busy machine (with 2 s, rank 1 could give up at the first argument check)."""
    answers = run_isolated(2, _compiled_with_fault, 10.0, 60.0)
    assert "stand-in kernel failure on rank 1" in answers[1][1], answers[1]
    typ, msg = answers[0]
    assert typ == "RingCommError" and "(forward argument check)" in msg, (typ, msg)
    assert "rank 0 of the CP group gave up" in msg and "no answer within 10 s. " in msg, msg
    assert FIX in msg and "timeout=SECONDS" in msg, msg
