"""``cp-compile plan``'s comparison of the context-parallel strategies: ring, Ulysses and 2-D.

Every number comes from the one cost model, :mod:`cp_compile.ulysses.cost` (``strategy_cost``), on an
:class:`~cp_compile.ulysses.cost.AttentionShape` built from the model (batch = the micro-batch, H, H_kv,
head dim, S padded to the layout's multiple, the dtype's bytes, causal): per attention layer, per GPU,
per training step (forward + backward), the bytes sent (all-to-all, ring K/V, ring dK/dV), the time
(exposed all-to-alls + ring steps whose transfer hides behind compute), whether the ring's transfer
hides, and the attention operands' memory. This module only lays them out and names the cheapest.

The Ulysses degree u of the 2-D strategy (u ranks of a node x a ring over r = N/u) defaults to
``min(node_gpus, N)`` when that divides N and is below N, else N's largest proper divisor.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..hardware import Hardware
from ..ulysses.cost import AttentionShape, StrategyCost, compare, largest_proper_divisor, strategy_cost
from ..ulysses.heads import HeadPlan

CHOICES = ("ring", "ulysses", "2d", "all")
MIB = 2**20


def default_ulysses_degree(hw: Hardware, gpus: int) -> int:
    """u of the 2-D strategy: ``min(node_gpus, N)`` if it divides N and is < N, else the largest proper
    divisor of N (1 when N has none: no 2-D split)."""
    u = min(hw.node_gpus, gpus)
    if gpus % u == 0 and u < gpus:
        return u
    return largest_proper_divisor(gpus)


def degree_error(gpus: int, strategy: str, degree: Optional[int], hw: Hardware) -> Optional[str]:
    """Why ``--strategy``/``--ulysses-degree`` cannot be planned on ``gpus`` GPUs, with the fix; None if
    they can."""
    divisors = [d for d in range(2, gpus) if gpus % d == 0]
    choices = f"one of {', '.join(map(str, divisors))}" if divisors else "none exists: N is prime or 1"
    if degree is not None and strategy in ("ring", "ulysses"):
        return (f"--ulysses-degree {degree} applies to --strategy 2d or all (the ring has u = 1, Ulysses u = N). "
                f"Fix: drop --ulysses-degree, or --strategy 2d.")
    if degree is not None and (gpus % degree or not 1 < degree < gpus):
        return (f"--ulysses-degree {degree} must divide --gpus {gpus} and lie strictly between 1 and {gpus} "
                f"(u = 1 is the ring, u = N Ulysses). Fix: --ulysses-degree {choices}.")
    if strategy in ("ulysses", "2d") and gpus == 1:
        return f"--strategy {strategy} needs --gpus > 1. Fix: more GPUs, or --strategy ring."
    if strategy == "2d" and default_ulysses_degree(hw, gpus) == 1:
        return (f"--strategy 2d needs a u with 1 < u < N dividing N = {gpus} ({choices}). "
                "Fix: --gpus with a proper divisor, or --strategy ulysses / ring.")
    return None


def strategy_costs(shape: AttentionShape, gpus: int, hw: Hardware, strategy: str,
                   degree: Optional[int]) -> List[StrategyCost]:
    """The costs of the strategies asked (``all``: every one that exists on ``gpus`` GPUs)."""
    u = degree if degree is not None else default_ulysses_degree(hw, gpus)
    if strategy == "all":
        return compare(shape, gpus, u, hw)
    return [strategy_cost(shape, gpus, strategy, u if strategy == "2d" else None, hw)]


def fmt_bytes(n: float) -> str:
    """Bytes as the table prints them: MiB with one decimal, GiB from 10 GiB on, plain B under 1 MiB."""
    if n >= 10 * 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{int(n)} B"


def fmt_time(sec: float) -> str:
    """Seconds as the table prints them (3 significant digits, in s, ms or us)."""
    if sec >= 1:
        return f"{sec:.3g} s"
    if sec >= 1e-3:
        return f"{sec * 1e3:.3g} ms"
    return f"{sec * 1e6:.3g} us" if sec >= 1e-6 or sec == 0 else f"{sec * 1e9:.3g} ns"


def _reach(hw: Hardware, span: int) -> str:
    if hw.inter_gbps is None:
        return "one flat network"
    return "across nodes" if span > hw.node_gpus else "inside a node"


def heads_text(heads: int, kv_heads: int, u: int) -> str:
    """How Ulysses over ``u`` ranks splits the heads: padding and K/V replication shown."""
    plan = HeadPlan(heads, kv_heads, u)
    pad = f" (padded to {plan.padded}: {plan.padded - heads} zero heads)" if plan.padded != heads else ""
    sent = u * plan.kv_per_rank
    rep = f" (replicated x{sent / kv_heads:g})" if sent > kv_heads else ""
    return f"heads {heads} -> {plan.per_rank}/rank{pad}, K/V {kv_heads} -> {plan.kv_per_rank}/rank{rep}"


def detail(c: StrategyCost, heads: int, kv_heads: int, hw: Hardware) -> str:
    """One line per strategy: its head split and the links its transfers take."""
    parts = [heads_text(heads, kv_heads, c.u) if c.u > 1 else f"heads {heads}, K/V {kv_heads} whole on every rank"]
    if c.u > 1:
        parts.append(f"all-to-all over {c.u} ranks at {hw.link_gbps(c.u):g} GB/s ({_reach(hw, c.u)})")
    if c.r > 1:
        span = c.u * (c.r - 1) + 1
        apart = f" {c.u} apart" if c.u > 1 else ""
        parts.append(f"ring over {c.r} ranks{apart} at {hw.stride_gbps(c.u, c.r):g} GB/s ({_reach(hw, span)})")
    return f"  {c.strategy:8} " + "; ".join(parts)


def _transfer(c: StrategyCost) -> str:
    ring = ("ring hidden" if c.ring_hidden else "ring-bound") if c.r > 1 else ""
    return ", ".join(filter(None, [ring, "a2a exposed" if c.u > 1 else ""]))


def why_cheapest(costs: List[StrategyCost], heads: int, kv_heads: int, hw: Hardware) -> str:
    """``cheapest ...`` line: the fastest strategy, the runner-up, and the part of the runner-up's time
    (compute of padded heads, exposed all-to-all, ring hops not hidden) that loses it the most."""
    best = min(costs, key=lambda c: c.seconds)
    runner = min((c for c in costs if c is not best), key=lambda c: c.seconds)
    exposed = lambda c: c.seconds - c.compute_seconds - c.a2a_seconds  # noqa: E731
    gaps = {"compute": runner.compute_seconds - best.compute_seconds,
            "a2a": runner.a2a_seconds - best.a2a_seconds, "ring": exposed(runner) - exposed(best)}
    key = max(gaps, key=lambda k: gaps[k])
    if gaps[key] <= 0:
        reason = f"it ties with {runner.strategy}"
    elif key == "compute":
        padded = HeadPlan(heads, kv_heads, runner.u).padded
        reason = (f"{runner.strategy}: pads {heads} heads to {padded} over u = {runner.u} ranks "
                  f"({padded / heads:.2g}x the attention FLOPs)")
    elif key == "a2a":
        reason = (f"{runner.strategy}: its all-to-all over {runner.u} ranks is exposed, "
                  f"{fmt_time(runner.a2a_seconds)} at {hw.link_gbps(runner.u):g} GB/s ({_reach(hw, runner.u)}; "
                  f"{best.strategy}: {fmt_time(best.a2a_seconds)})")
    else:
        reason = (f"{runner.strategy}: its ring over {runner.r} ranks does not hide behind compute at "
                  f"{hw.stride_gbps(runner.u, runner.r):g} GB/s ({fmt_time(exposed(runner))} exposed; "
                  f"{best.strategy}: {fmt_time(exposed(best))})")
    others = ", ".join(f"{c.strategy} {fmt_time(c.seconds)}" for c in sorted(costs, key=lambda c: c.seconds)[1:])
    return f"cheapest  {best.strategy} ({fmt_time(best.seconds)} per layer per step; {others}): {reason}"


HEADER = (f"  {'strategy':8} {'u x r':7} {'all-to-all':>11} {'ring K/V':>11} {'ring dK/dV':>11} {'total':>11} "
          f"{'time':>9} {'compute':>9}  {'transfer':24} {'memory':>11}")


def row(c: StrategyCost) -> str:
    """One strategy's line of the table (bytes of :func:`fmt_bytes`, times of :func:`fmt_time`)."""
    b = [fmt_bytes(x) for x in (c.a2a_bytes, c.ring_kv_bytes, c.ring_acc_bytes, c.total_bytes)]
    return (f"  {c.strategy:8} {f'{c.u} x {c.r}':7} {b[0]:>11} {b[1]:>11} {b[2]:>11} {b[3]:>11} "
            f"{fmt_time(c.seconds):>9} {fmt_time(c.compute_seconds):>9}  {_transfer(c):24} "
            f"{fmt_bytes(c.memory_bytes):>11}")


def strategy_lines(costs: List[StrategyCost], shape: AttentionShape, hw: Hardware,
                   missing: List[Tuple[str, str]]) -> List[str]:
    """The comparison table, one detail line per strategy, the strategies that do not exist, the cheapest."""
    lines = [f"strategies, per attention layer per GPU per training step (forward + backward), batch {shape.batch}, "
             f"S = {shape.seq_len} (cp_compile.ulysses.cost)",
             "  bytes sent; time = exposed all-to-all + ring steps (each the max of compute and transfer); "
             "memory = attention operands (head-sharded q, k, v, out; 2 K/V blocks + 2 dK/dV accumulators)",
             HEADER, *map(row, costs)]
    lines += [detail(c, shape.heads, shape.kv_heads, hw) for c in costs]
    lines += [f"  {name:8} not planned: {why}" for name, why in missing]
    if len(costs) > 1:
        lines.append(why_cheapest(costs, shape.heads, shape.kv_heads, hw))
    return lines


def missing_strategies(costs: List[StrategyCost], gpus: int) -> List[Tuple[str, str]]:
    """(strategy, why) of each strategy ``--strategy all`` could not plan on ``gpus`` GPUs."""
    have = {c.strategy for c in costs}
    out = []
    if "ulysses" not in have:
        out.append(("ulysses", "needs N > 1"))
    if "2d" not in have:
        out.append(("2d", f"needs a u with 1 < u < N dividing N = {gpus}"))
    return out
