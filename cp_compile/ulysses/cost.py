"""What one attention costs each rank under each strategy: bytes sent, attention FLOPs, time on a
:class:`cp_compile.hardware.Hardware`. One model, read by ``strategy="auto"``
(:mod:`cp_compile.passes.finalize.strategy`), by ``cp-compile plan`` and by ``cp-compile explain``,
and checked against bytes counted on a CPU run (:mod:`cp_compile.traffic`).

Per attention, per rank, per training step (forward + backward), with ``c = S/N`` tokens per rank,
``e`` bytes per element, ``a = max(4, e)`` the dK/dV accumulator's, on ``N = u·r`` ranks
(:class:`cp_compile.ulysses.heads.HeadPlan` gives ``Hp``, the padded query heads, and ``m``, the K/V
heads a rank receives)::

    all-to-all (u > 1)   2 · (u-1)/u · B·c·D·e · (2·Hp + 2·u·m)      q, k, v, out; dout, dq, dk, dv
    ring (r > 1, p2p)    (r-1) · KV  +  (r-1) · KV  +  r · KV·a/e    K/V forward; K/V and dK/dV backward
                         KV = 2·B·m·(u·c)·D·e  (m = H_kv when u = 1)

``ring`` is u = 1, ``ulysses`` is r = 1 (the local attention sees the whole sequence), ``2d`` both.
The mask form counts: the causal flag sets the work fraction f below, and an explicit per-query mask
(``mask_bytes``: what this rank holds of it, rows of its c queries over all S keys, ``mask_heads`` of
them) travels with the queries under Ulysses, forward only (a mask is a constant):
``(u-1) · mask_bytes · s / mask_heads`` more all-to-all bytes, s = hq slots for a per-head mask, 1 for
one shared by every head.
Memory per rank for the attention's operands beyond the model's own (``memory_bytes``): Ulysses'
head-sharded q, k, v, out, ``B·(u·c)·D·e·(2·hq + 2·m)`` (u > 1, ``hq = Hp/u``), plus the ring's 2 K/V
blocks and 2 dK/dV accumulators (``a`` bytes each), ``2·KV + 2·KV·a/e`` (r > 1).
Time: the all-to-alls are exposed (they precede and follow the attention); each ring step's transfer
hides behind the step's compute (``max`` of the two, the ring's double buffering); compute is
``4·f·B·S·c·D·Hp`` FLOPs forward and 2.5x that backward (f = 1/2 causal, 1 otherwise). ``seconds``
splits into ``compute_seconds`` (the FLOPs alone), ``a2a_seconds`` (exposed all-to-alls) and what the
ring's hops add where they do not hide (``ring_hidden``: every hop hides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..hardware import Hardware
from .heads import HeadPlan

STRATEGIES = ("ring", "ulysses", "2d")


@dataclass(frozen=True)
class AttentionShape:
    """One attention as the whole sequence sees it."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int  # S, padded to the layout's multiple
    elem_bytes: int = 2
    causal: bool = True
    mask_bytes: int = 0  # an explicit per-query mask: the bytes of this rank's rows (0: none)
    mask_heads: int = 1  # its head dim (1: one mask for every head)


@dataclass(frozen=True)
class StrategyCost:
    """One strategy's cost for one attention on each rank, per training step."""

    strategy: str
    u: int  # Ulysses degree (1: ring)
    r: int  # ring size (1: Ulysses)
    a2a_bytes: int  # all-to-all bytes sent, forward + backward
    ring_kv_bytes: int  # K/V hops, forward + backward
    ring_acc_bytes: int  # dK/dV accumulator hops (backward)
    flops: float  # attention FLOPs, forward + backward
    kv_block_bytes: int  # one K/V block the ring holds (two are alive at once)
    memory_bytes: int = 0  # attention operands per rank beyond the model's (module docstring)
    seconds: float = 0.0  # on the hardware priced (0 when none)
    compute_seconds: float = 0.0  # the attention FLOPs alone, on the hardware priced
    a2a_seconds: float = 0.0  # the all-to-alls (exposed)
    ring_hidden: bool = True  # every ring hop, forward and backward, hides behind its step's compute

    @property
    def total_bytes(self) -> int:
        return self.a2a_bytes + self.ring_kv_bytes + self.ring_acc_bytes

    @property
    def ring_bytes(self) -> int:
        return self.ring_kv_bytes + self.ring_acc_bytes


def largest_proper_divisor(n: int) -> int:
    """The largest d < n dividing n (1 when there is none: n prime or 1)."""
    return max((d for d in range(1, n) if n % d == 0), default=1)


def split(strategy: str, world: int, u: Optional[int]) -> Tuple[int, int]:
    """(u, r) of ``strategy`` on ``world`` ranks; ``u``: the asked Ulysses degree of 2d (None: the
    largest proper divisor of ``world``)."""
    if strategy == "ring":
        return 1, world
    if strategy == "ulysses":
        return world, 1
    deg = u if u is not None else largest_proper_divisor(world)
    return deg, world // deg


def strategy_cost(shape: AttentionShape, world: int, strategy: str, u: Optional[int] = None,
                  hw: Optional[Hardware] = None) -> StrategyCost:
    """The cost of ``shape`` under ``strategy`` on ``world`` ranks (module docstring)."""
    deg, r = split(strategy, world, u)
    plan = HeadPlan(shape.heads, shape.kv_heads, deg)
    c, e, D, B = shape.seq_len // world, shape.elem_bytes, shape.head_dim, shape.batch
    m = plan.kv_per_rank if deg > 1 else shape.kv_heads
    hp, _ = plan.sent()
    a2a = 2 * (deg - 1) * B * c * D * e * (2 * plan.per_rank + 2 * m) if deg > 1 else 0
    slots = 1 if shape.mask_heads == 1 else plan.per_rank
    a2a += (deg - 1) * shape.mask_bytes * slots // shape.mask_heads  # the mask's rows go with the queries
    kv = 2 * B * m * (deg * c) * D * e
    acc = kv * max(4, e) // e
    ring_kv, ring_acc = (2 * (r - 1) * kv, r * acc) if r > 1 else (0, 0)
    heads_mem = B * (deg * c) * D * e * (2 * plan.per_rank + 2 * m) if deg > 1 else 0  # q, out; k, v
    memory = heads_mem + (2 * kv + 2 * acc if r > 1 else 0)
    f = 0.5 if shape.causal else 1.0
    fwd_flops = 4 * f * B * shape.seq_len * c * D * hp  # this rank's share: c queries' worth of Hp heads
    cost = StrategyCost(strategy, deg, r, a2a, ring_kv, ring_acc, 3.5 * fwd_flops, kv, memory)
    if hw is None:
        return cost
    return StrategyCost(**{**cost.__dict__, **_seconds(cost, hw, fwd_flops)})


def _seconds(cost: StrategyCost, hw: Hardware, fwd_flops: float) -> dict:
    """Exposed all-to-alls + ring steps (each the max of its compute and its transfer), and its parts."""
    flops_s = hw.tflops * 1e12
    a2a_s = cost.a2a_bytes / (hw.link_gbps(cost.u) * 1e9) if cost.u > 1 else 0.0
    parts = {"compute_seconds": 3.5 * fwd_flops / flops_s, "a2a_seconds": a2a_s, "ring_hidden": True}
    if cost.r == 1:
        return {**parts, "seconds": a2a_s + parts["compute_seconds"]}
    bw = hw.stride_gbps(cost.u, cost.r) * 1e9
    step_fwd, step_bwd = fwd_flops / cost.r / flops_s, 2.5 * fwd_flops / cost.r / flops_s
    hop_fwd = cost.kv_block_bytes / bw
    hop_bwd = (cost.ring_kv_bytes / 2 / (cost.r - 1) + cost.ring_acc_bytes / cost.r) / bw
    ring_s = (step_fwd + step_bwd) + (cost.r - 1) * (max(step_fwd, hop_fwd) + max(step_bwd, hop_bwd))
    return {**parts, "seconds": a2a_s + ring_s, "ring_hidden": hop_fwd <= step_fwd and hop_bwd <= step_bwd}


def compare(shape: AttentionShape, world: int, u: Optional[int], hw: Hardware) -> List[StrategyCost]:
    """Every strategy that exists on ``world`` ranks (2d needs 1 < u < world), priced on ``hw``."""
    out = [strategy_cost(shape, world, "ring", hw=hw)]
    if world > 1:
        out.append(strategy_cost(shape, world, "ulysses", hw=hw))
    deg, _ = split("2d", world, u)
    if 1 < deg < world:
        out.append(strategy_cost(shape, world, "2d", deg, hw))
    return out
