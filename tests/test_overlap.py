"""The ring overlaps its K/V (and dK/dV) transfers with compute.

On 2 busy CPU cores gloo cannot overlap *real* compute (both need the CPU), so the
schedule is measured with a stand-in block kernel that sleeps ``T`` seconds per
call (a sleeping rank leaves the CPU to gloo's transfer threads) and real gloo
transfers of large K/V blocks.

Bookkeeping (stacking, merging, adding gradients) is CPU work that cannot hide
behind a sleep; it appears in both timings below and cancels out. Per rank and
direction we time, best of a few repeats:
* ``W0``: the ring with a zero-time kernel: transfers + bookkeeping, nothing to hide behind;
* ``WT``: the ring with the ``T``-second kernel;
* ``X``:  one blocking ring hop of the packed K/V buffer.
Without overlap ``WT ≈ W0 + N·T``; with overlap the transfers hide behind the sleeps,
so ``hidden = W0 + N·T − WT`` approaches the hideable transfer time. The forward can
hide its N−1 K/V hops; the backward its N−1 K/V hops and N−1 of its N dK/dV hops
(the last one lands after the last compute).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import cp_compile
from cp_compile._group import resolve_group
from cp_compile.kernels import register_kernel
from cp_compile.ring.comm import GradSink, _ring_exchange, _wait, kv_blocks

SLEEP_S = 0.25
LOCAL_LEN = 262_144  # c: K and V are (1, 1, c, 32) fp32 = 32 MiB each, 64 MiB per hop
REPEATS = 3


class SleepKernel:
    """Stand-in block kernel: takes ``seconds`` per call, returns zeros of the right shapes."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name, self.seconds = name, seconds

    def supports(self, device, dtype):
        return True

    def forward(self, q, k, v, *, causal, scale):
        time.sleep(self.seconds)
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:-1], dtype=torch.float32)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        time.sleep(self.seconds)
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure_schedule(seconds: float):
    """On every rank: best-of-REPEATS wall times of one hop, forward and backward rings."""
    torch.manual_seed(dist.get_rank())
    register_kernel(SleepKernel("sleep_0", 0.0), replace=True)
    register_kernel(SleepKernel("sleep_T", seconds), replace=True)
    q, k, v = (torch.randn(1, 1, LOCAL_LEN, 32) for _ in range(3))
    bufs = [torch.empty_like(k), torch.empty_like(v)]
    group = resolve_group(None)

    def fwd(kernel):
        return cp_compile.ring_attention(q, k, v, kernel=kernel, load_balance="contiguous")

    def bwd(kernel):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = cp_compile.ring_attention(qq, kk, vv, kernel=kernel, load_balance="contiguous")
        return lambda: out.backward(torch.ones_like(out))

    res = {"hop": [], "fwd0": [], "fwdT": [], "bwd0": [], "bwdT": []}
    for _ in range(REPEATS):
        res["hop"].append(_timed(lambda: _wait(_ring_exchange([k, v], bufs, group, 0))))
        res["fwd0"].append(_timed(lambda: fwd("sleep_0")))
        res["fwdT"].append(_timed(lambda: fwd("sleep_T")))
        res["bwd0"].append(_timed(bwd("sleep_0")))
        res["bwdT"].append(_timed(bwd("sleep_T")))
    return {key: min(vals) for key, vals in res.items()}


def _schedule_report(m: dict, n: int, t: float) -> tuple:
    """(whether the schedule hid the transfers, a report) for one rank's best-of times."""
    hop = m["hop"]
    hidden_fwd = m["fwd0"] + n * t - m["fwdT"]
    hidden_bwd = m["bwd0"] + n * t - m["bwdT"]
    ok = (hop > 0.01  # the transfers are real and not negligible
          # Compute-bound ring: wall ≈ N·T plus bookkeeping, not N·T + transfers.
          and hidden_fwd >= 0.6 * (n - 1) * hop and hidden_bwd >= 0.6 * 2 * (n - 1) * hop
          and m["fwdT"] >= n * t and m["bwdT"] >= n * t)
    return ok, f"{m} -> hidden fwd {hidden_fwd:.3f}s, bwd {hidden_bwd:.3f}s"


def test_ring_op_hides_transfers_behind_compute(ranks):
    """The whole op (forward and backward) on 2 ranks: 2 processes, 2 cores, no contention.

    Best of REPEATS per timing; when a rank misses the bound (a page-faulting or busy
    moment late in a long suite has cost one run its whole overlap), the measurement
    is repeated once and each timing is the best of both rounds."""
    n, t = 2, SLEEP_S
    per_rank = ranks.run(2, _measure_schedule, SLEEP_S, timeout=300)
    if not all(_schedule_report(m, n, t)[0] for m in per_rank):
        again = ranks.run(2, _measure_schedule, SLEEP_S, timeout=300)
        per_rank = [{k: min(a[k], b[k]) for k in a} for a, b in zip(per_rank, again)]
    for rank, m in enumerate(per_rank):
        ok, report = _schedule_report(m, n, t)
        assert ok, f"rank {rank}: {report}"


def _measure_rotation(seconds: float, local_len: int):
    """The communication schedule alone: K/V stream + dK/dV sink with a sleeping consumer.

    Returns best-of-REPEATS wall times with a zero-time and a ``seconds`` consumer,
    each step doing what the backward loop does: take the block, "compute", hand a
    dK/dV buffer to the sink.
    """
    group = resolve_group(None)
    k, v, dk, dv = (torch.randn(1, 1, local_len, 32) for _ in range(4))

    def ring(sleep_s):
        sink = GradSink(k, k.dtype, group, "p2p")
        for step, src, _k, _v in kv_blocks(k, v, group, "p2p"):
            time.sleep(sleep_s)
            sink.add(step, src, dk, dv)
        sink.finish()

    w0 = min(_timed(lambda: ring(0.0)) for _ in range(REPEATS))
    wt = min(_timed(lambda: ring(seconds)) for _ in range(REPEATS))
    bufs = [torch.empty_like(k), torch.empty_like(v)]
    hop = min(_timed(lambda: _wait(_ring_exchange([k, v], bufs, group, 0))) for _ in range(REPEATS))
    return {"w0": w0, "wt": wt, "hop": hop}


# Smaller blocks on 4 ranks: 4 processes share 2 cores, so each hop is slower, and a
# step's two concurrent hops (K/V and dK/dV) must still fit inside one compute step.
@pytest.mark.parametrize("world,local_len", [(2, LOCAL_LEN), (4, LOCAL_LEN // 4)])
def test_rotation_schedule_overlaps(ranks, world, local_len):
    """K/V hops and all but the last dK/dV hop run while the ranks compute."""
    per_rank = ranks.run(world, _measure_rotation, SLEEP_S, local_len, timeout=300)
    for rank, m in enumerate(per_rank):
        hidden = m["w0"] + world * SLEEP_S - m["wt"]
        hideable = 2 * (world - 1) * m["hop"]  # N-1 K/V hops + N-1 of the N dK/dV hops
        report = f"rank {rank}: {m} -> hidden {hidden:.3f}s of {hideable:.3f}s hideable"
        print(report)
        assert m["w0"] >= (2 * world - 1) * 0.5 * m["hop"], report  # 2N-1 real hops happened
        assert hidden >= 0.5 * hideable, report  # without overlap, hidden ≈ 0
