"""The ring overlaps its transfers with compute: checked on the schedule, not on timings.

Overlap is a property of the order in which a rank posts a transfer, computes and
waits: a transfer posted before a kernel call and waited after it is in flight
during that call, however fast or slow the machine is. So each rank records that
order and the test asserts it exactly:

* :func:`_record_schedule` wraps the ring's two communication primitives,
  ``cp_compile.ring.comm._ring_exchange`` (post a hop) and ``_wait``, which
  :func:`~cp_compile.ring.comm.kv_blocks` and :class:`~cp_compile.ring.comm.GradSink`
  look up at call time; a stand-in kernel logs its calls and which rank's block it
  got (every rank fills its K with its rank number);
* recorded: the forward and the backward of ``cp_compile.ring_attention`` with
  ``rotate="p2p"`` on 2 and 4 ranks, through the block-kernel loops
  (:mod:`cp_compile.ring.loops`) and the fused ones (:mod:`cp_compile.ring.fused`,
  a stand-in kernel with ``fuses_merge``), non-causal (one kernel call per step) and
  causal (contiguous layout: steps against a later rank's block run no kernel);
  and the rotation primitives driven by hand, as ``benchmarks/bench_overlap.py`` does;
* asserted: the K/V hop for step t+1 is posted before step t's kernel calls and
  waited after them; in the backward the dK/dV accumulator leaving at step t is
  posted before step t+1's kernel calls and waited after them (the last one lands
  after the last step); the whole event sequence equals the one built from N and
  the rank (no extra wait, no missing hop); every hop posted is waited; every rank
  posts and waits the same hops in the same order (SPMD).

Whether the transfers then *run* concurrently with the compute depends on the
transport and the machine: ``benchmarks/bench_overlap.py`` measures that, no test
asserts on it. The numbers are checked by tests/test_ring_exact.py and others.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist

import cp_compile
from cp_compile.group import resolve_group
from cp_compile.kernels import register_kernel
from cp_compile.ring import comm

KV, GRAD = "K/V", "dK/dV"  # Hop.kind of the K/V hops and of the dK/dV accumulator hops
Event = Tuple[str, str, int]  # ("post" | "wait", kind, step) or ("kernel", method, src)


# --------------------------------------------------------------------------- recording (in the workers)


@contextlib.contextmanager
def _record_schedule(events: List[Event]) -> Iterator[Dict[int, tuple]]:
    """Within: each post of a ring hop appends ``("post", kind, step)`` to ``events``, each
    wait ``("wait", kind, step)`` of the hop it waits for (``step``: the ring step that
    needs the data, :attr:`cp_compile.ring.faults.Hop.step`). Yields the hops posted and
    not waited yet, {id: (hop, kind, step)}: empty again after a complete ring."""
    post, wait = comm._ring_exchange, comm._wait
    pending: Dict[int, tuple] = {}

    def recording_post(sends, recvs, group, tag, step=1):
        hop = post(sends, recvs, group, tag, step)
        pending[id(hop)] = (hop, hop.kind, hop.step)
        events.append(("post", hop.kind, hop.step))
        return hop

    def recording_wait(hop) -> None:
        _, kind, step = pending.pop(id(hop), (hop, f"never posted {hop.kind}", hop.step))
        events.append(("wait", kind, step))
        wait(hop)

    comm._ring_exchange, comm._wait = recording_post, recording_wait
    try:
        yield pending
    finally:
        comm._ring_exchange, comm._wait = post, wait


class ProbeKernel:
    """Stand-in block kernel: logs ``("kernel", method, src)`` per call and returns zeros.

    ``src``, the rank whose K/V block the call sees, is read from the keys: every rank
    fills its K with its own rank number."""

    name = "schedule_probe"

    def __init__(self, events: List[Event]) -> None:
        self.events = events

    def supports(self, device, dtype) -> bool:
        return True

    def _log(self, method: str, k) -> None:
        self.events.append(("kernel", method, int(k[0, 0, 0, 0])))

    def forward(self, q, k, v, *, causal, scale):
        self._log("forward", k)
        return torch.zeros_like(q), q.new_zeros(q.shape[:-1])  # out (B, H, Lq, D), lse (B, H, Lq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        self._log("backward", k)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class FusedProbeKernel(ProbeKernel):
    """Stand-in :class:`cp_compile.kernels.StepKernel` (``fuses_merge``): the loops of
    :mod:`cp_compile.ring.fused` call ``forward_step`` / ``backward_step`` once per step."""

    name = "schedule_probe_fused"
    fuses_merge = True

    def new_state(self, q):
        return (torch.zeros(q.shape, dtype=torch.float32),)  # (B, H, c, D)

    def forward_step(self, q, k, v, state, q_pos, k_pos, **_):
        self._log("forward_step", k)

    def finalize(self, state, dtype):
        return state[0].to(dtype), state[0].new_zeros(state[0].shape[:-1])  # out, lse (B, H, c)

    def delta(self, dout, out):
        return torch.zeros(dout.shape[:-1], dtype=torch.float32)  # (B, H, c)

    def backward_step(self, dout, q, k, v, lse, delta, grads, q_pos, k_pos, **_):
        self._log("backward_step", k)


def _ring_schedule(fused: bool, causal: bool):
    """On every rank: (forward events, backward events, hops left unwaited) of one
    ``ring_attention`` call, contiguous layout, p2p rotation."""
    events: List[Event] = []
    kernel = (FusedProbeKernel if fused else ProbeKernel)(events)
    register_kernel(kernel, replace=True)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)  # (B, H, c, D)
    k = torch.full((1, 1, 4, 8), float(dist.get_rank()), requires_grad=True)  # (B, H_kv, c, D)
    v = torch.randn(1, 1, 4, 8, requires_grad=True)
    with _record_schedule(events) as pending:
        out = cp_compile.ring_attention(q, k, v, causal=causal, load_balance="contiguous", kernel=kernel.name)
        forward = list(events)
        events.clear()
        out.backward(torch.ones_like(out))
    return forward, list(events), [(kind, step) for _, kind, step in pending.values()]


def _rotation_schedule():
    """On every rank: the backward's rotation driven by hand (``kv_blocks`` + ``GradSink``,
    one "compute" per step, each rank contributing rank+1 to every block's dK/dV):
    (events, hops left unwaited, the dK that came home)."""
    r, group = dist.get_rank(), resolve_group(None)
    k = torch.full((1, 1, 4, 8), float(r))  # (B, H_kv, c, D)
    events: List[Event] = []
    with _record_schedule(events) as pending:
        sink = comm.GradSink(k, k.dtype, group, "p2p")
        for step, src, k_src, _ in comm.kv_blocks(k, k.clone(), group, "p2p"):
            events.append(("kernel", "compute", int(k_src[0, 0, 0, 0])))
            sink.add(step, src, torch.full_like(k, r + 1.0), torch.full_like(k, r + 1.0))
        dk, _ = sink.finish()
    return events, [(kind, step) for _, kind, step in pending.values()], dk


# --------------------------------------------------------------------------- expected schedules

Calls = Callable[[int], int]  # src -> kernel calls of the step against rank src's block


def _expected_forward(n: int, r: int, calls: Calls, method: str) -> List[Event]:
    """Rank r of n: the hop bringing step t+1's block is posted before step t's compute and
    waited after it (double buffering); the last step posts nothing."""
    events: List[Event] = []
    for t in range(n):
        src = (r - t) % n
        if t < n - 1:
            events.append(("post", KV, t + 1))
        events += [("kernel", method, src)] * calls(src)
        if t < n - 1:
            events.append(("wait", KV, t + 1))
    return events


def _expected_backward(n: int, r: int, calls: Calls, method: str) -> List[Event]:
    """As the forward for K/V; block src's dK/dV accumulator arrives (from rank r-1, which
    posted it at its step t-1) after step t's compute, gets this rank's share and leaves
    for rank r+1 at once, so each accumulator hop spans the next step's compute. The
    hop posted at the last step brings every block's dK/dV home."""
    events: List[Event] = []
    for t in range(n):
        src = (r - t) % n
        if t < n - 1:
            events.append(("post", KV, t + 1))
        events += [("kernel", method, src)] * calls(src)
        if t > 0:
            events.append(("wait", GRAD, t))
        events.append(("post", GRAD, t + 1))
        if t < n - 1:
            events.append(("wait", KV, t + 1))
    events.append(("wait", GRAD, n))
    return events


def _index(events: List[Event], event: Event, where: str) -> int:
    assert event in events, f"{where}: no {event} in {events}"
    return events.index(event)


def _assert_in_flight(events: List[Event], kind: str, hop_step: int, step: int, r: int, n: int, where: str) -> None:
    """The hop (kind, hop_step) is posted before, and waited after, every kernel call of ring ``step``."""
    post, wait = _index(events, ("post", kind, hop_step), where), _index(events, ("wait", kind, hop_step), where)
    calls = [i for i, (what, _, src) in enumerate(events) if what == "kernel" and (r - src) % n == step]
    assert all(post < i < wait for i in calls), (
        f"{where}: the {kind} hop for step {hop_step} (posted at event {post}, waited at {wait}) is not in flight "
        f"during step {step}'s kernel calls (events {calls}): {events}"
    )


def _assert_same_hops_on_every_rank(per_rank: List[List[Event]]) -> None:
    hops = [[e for e in events if e[0] != "kernel"] for events in per_rank]
    for r, h in enumerate(hops):
        assert h == hops[0], f"rank {r} posts/waits {h}, rank 0 {hops[0]}: not SPMD"


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fused", [False, True], ids=["block", "fused"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_schedule_overlaps(ranks, world, fused, causal):
    """ring_attention's forward and backward post each hop before the compute it hides
    behind and wait for it after, on every rank alike."""
    per_rank = ranks.run(world, _ring_schedule, fused, causal, timeout=120)
    fwd_method, bwd_method = ("forward_step", "backward_step") if fused else ("forward", "backward")
    for r, (fwd, bwd, unwaited) in enumerate(per_rank):
        for t in range(world - 1):
            _assert_in_flight(fwd, KV, t + 1, t, r, world, f"rank {r} forward")
            _assert_in_flight(bwd, KV, t + 1, t, r, world, f"rank {r} backward")
            _assert_in_flight(bwd, GRAD, t + 1, t + 1, r, world, f"rank {r} backward")

        def calls(src: int) -> int:  # contiguous layout: causally, a later rank's block is invisible
            return 0 if causal and src > r else 1

        assert fwd == _expected_forward(world, r, calls, fwd_method), f"rank {r} forward"
        assert bwd == _expected_backward(world, r, calls, bwd_method), f"rank {r} backward"
        assert unwaited == [], f"rank {r}: hops never waited: {unwaited}"
    _assert_same_hops_on_every_rank([fwd + bwd for fwd, bwd, _ in per_rank])


@pytest.mark.parametrize("world", [2, 4])
def test_rotation_schedule_overlaps(ranks, world):
    """kv_blocks + GradSink alone: the K/V hops and all but the last dK/dV hop are in
    flight during a step's compute, each step sees the right block, and every block's
    dK/dV comes home summed over all ranks."""
    per_rank = ranks.run(world, _rotation_schedule, timeout=120)
    for r, (events, unwaited, dk) in enumerate(per_rank):
        for t in range(world - 1):
            _assert_in_flight(events, KV, t + 1, t, r, world, f"rank {r}")
            _assert_in_flight(events, GRAD, t + 1, t + 1, r, world, f"rank {r}")
        assert events == _expected_backward(world, r, lambda src: 1, "compute"), f"rank {r}"
        assert unwaited == [], f"rank {r}: hops never waited: {unwaited}"
        torch.testing.assert_close(dk, torch.full((1, 1, 4, 8), world * (world + 1) / 2))
    _assert_same_hops_on_every_rank([events for events, _, _ in per_rank])
