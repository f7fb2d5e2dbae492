"""Which strategy one attention gets, and why: the rule ``strategy=`` and ``ulysses_degree=`` give, or,
under ``"auto"``, the cheapest strategy on the hardware profile by :mod:`.cost`.

Pure (no graph, no group): :func:`choose` takes what the ring call says of the attention. A strategy
that cannot run an attention is never silently swapped: the :class:`Decision` says why it fell back to
the ring (``forced`` decisions are logged as a WARNING by the pass, ``auto`` ones at INFO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..hardware import Hardware
from .cost import AttentionShape, StrategyCost, compare, split, strategy_cost
from .groups import check_degree


@dataclass(frozen=True)
class Decision:
    """One attention's strategy: Ulysses degree ``u`` x ring size ``r`` (u = 1: the ring)."""

    strategy: str
    u: int
    r: int
    why: str
    fell_back: bool = False  # a forced strategy could not run this attention: the ring runs it (WARNING)

    @property
    def text(self) -> str:
        """:func:`label`, then why."""
        return f"{label(self.strategy, self.u, self.r)}: {self.why}"


def label(strategy: str, u: int, r: int) -> str:
    """``ring`` / ``ulysses u=4`` / ``2d u=2 x r=2``: a strategy as the record and explain name it."""
    return {"ring": "ring", "ulysses": f"ulysses u={u}"}.get(strategy, f"2d u={u} x r={r}")


def degree_for(strategy: str, world: int, degree: Optional[int]) -> int:
    """The Ulysses degree of a forced ``strategy`` on ``world`` ranks, or a ValueError naming the fix."""
    if strategy == "ulysses":
        if degree not in (None, world):
            raise ValueError(f"cp_compile: strategy='ulysses' with ulysses_degree={degree} on {world} ranks: "
                             f"Ulysses alone spans the CP group. Fix: strategy='2d' (Ulysses over {degree} x ring "
                             f"over {world // max(degree, 1)}), or drop ulysses_degree.")
        return world
    u, _ = split("2d", world, degree)
    check_degree(u, world)
    if not 1 < u < world:
        raise ValueError(f"cp_compile: strategy='2d' needs 1 < ulysses_degree < {world} (the CP group's size), "
                         f"got {u}. Fix: strategy='ulysses' for u = {world}, 'ring' for u = 1.")
    return u


def choose(strategy: str, world: int, degree: Optional[int], shape: Optional[AttentionShape],
           blocker: str, hw: Hardware) -> Decision:
    """The decision for one attention. ``shape``: None when its sizes are unknown (symbolic heads);
    ``blocker``: why Ulysses cannot run it ("" when it can)."""
    if strategy == "ring" or world == 1:
        return Decision("ring", 1, world, "strategy='ring'" if strategy == "ring" else "one rank")
    if strategy != "auto":
        u = degree_for(strategy, world, degree)
        why = blocker or ("" if shape is not None else "the head count is not known when compiling")
        if why:
            return Decision("ring", 1, world, f"strategy={strategy!r} cannot run it: {why}; the ring does",
                            fell_back=True)
        return Decision(strategy, u, world // u, _priced(shape, world, strategy, u, hw))
    if degree is not None:
        check_degree(degree, world)
    if blocker or shape is None:
        return Decision("ring", 1, world, f"auto: {blocker or 'the head count is not known when compiling'}")
    costs = compare(shape, world, degree, hw)
    best = min(costs, key=lambda c: (c.seconds, c.strategy != "ring"))  # a tie goes to the ring
    return Decision(best.strategy, best.u, best.r, "auto on " + hw.name + ": " + _table(costs, best))


def _priced(shape: Optional[AttentionShape], world: int, strategy: str, u: int, hw: Hardware) -> str:
    c = strategy_cost(shape, world, strategy, u, hw)
    return f"strategy={strategy!r}; {_one(c)}"


def _one(c: StrategyCost) -> str:
    return f"{c.strategy} {c.total_bytes / 2**20:.3g} MiB sent, {c.seconds * 1e3:.3g} ms"


def _table(costs: List[StrategyCost], best: StrategyCost) -> str:
    return f"cheapest {best.strategy} (" + "; ".join(_one(c) for c in costs) + " per step)"
