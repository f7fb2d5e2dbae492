"""Which heads each rank of a Ulysses group gets: q heads padded to the degree, K/V heads replicated
only as far as the ranks' query heads need them.

Ulysses over ``u`` ranks gives rank ``j`` a slice of the query heads. ``H`` need not divide by ``u``:
the heads are padded with zero heads to ``Hp = u·ceil(H/u)`` (their outputs are dropped and their
gradient is zero). K/V heads (``H_kv``, GQA ratio ``G = H / H_kv``) are not sent to every rank: rank
``j`` receives the K/V heads its query heads read, ``m`` of them, in an order under which its local
query head ``i`` reads local K/V head ``i // (hq / m)`` (the kernel's GQA rule)::

    H=8,  H_kv=8, u=2 -> hq=4, m=4   rank 0: q 0-3, kv 0-3         (MHA: split evenly)
    H=8,  H_kv=2, u=4 -> hq=2, m=1   rank 2: q 4-5, kv 1           (GQA: each kv head on 2 ranks)
    H=8,  H_kv=1, u=2 -> hq=4, m=1   rank 1: q 4-7, kv 0           (MQA: the one head replicated)
    H=6,  H_kv=6, u=4 -> hq=2, Hp=8  rank 3: q 6, 7 = zero heads   (padding)

The backward sums a replicated K/V head's gradients (``cp_compile::heads_to_seq``'s index_add).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


@dataclass(frozen=True)
class HeadPlan:
    """The head split of one attention over a Ulysses group of ``u`` ranks."""

    heads: int  # H, query heads
    kv_heads: int  # H_kv
    u: int  # Ulysses degree

    def __post_init__(self) -> None:
        if self.u < 1 or self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"cp_compile: no head plan for H={self.heads}, H_kv={self.kv_heads}, u={self.u} "
                             "(H must be a multiple of H_kv, u >= 1).")

    @property
    def per_rank(self) -> int:
        """hq: query heads each rank computes (padding included)."""
        return -(-self.heads // self.u)

    @property
    def padded(self) -> int:
        """Hp = u·hq: query heads after padding (Hp - H zero heads)."""
        return self.per_rank * self.u

    def global_head(self, j: int, i: int) -> int:
        """The query head rank ``j``'s local head ``i`` is (a zero head reads as the last real one)."""
        return min(j * self.per_rank + i, self.heads - 1)

    def _kv_of(self, j: int, i: int) -> int:
        return self.global_head(j, i) // (self.heads // self.kv_heads)

    @property
    def kv_per_rank(self) -> int:
        """m: K/V heads each rank receives, the fewest under which every rank's local GQA rule holds."""
        hq = self.per_rank
        for m in (d for d in range(1, hq + 1) if hq % d == 0):
            group = hq // m
            if all(self._kv_of(j, i) == self._kv_of(j, (i // group) * group)
                   for j in range(self.u) for i in range(hq)):
                return m
        return hq  # unreachable: m = hq always holds

    def q_index(self) -> List[int]:
        """(Hp,) the q head each sent slot carries, rank-major; -1 for a zero (padding) head."""
        return [g if g < self.heads else -1 for g in range(self.padded)]

    def kv_index(self) -> List[int]:
        """(u·m,) the K/V head each sent slot carries, rank-major (a head repeats for ranks sharing it)."""
        m, group = self.kv_per_rank, self.per_rank // self.kv_per_rank
        return [self._kv_of(j, s * group) for j in range(self.u) for s in range(m)]

    def head_map(self, j: int) -> List[int]:
        """(hq,) the global query head of each of rank ``j``'s local heads (what mods and masks index by)."""
        return [self.global_head(j, i) for i in range(self.per_rank)]

    def sent(self) -> Tuple[int, int]:
        """(q heads, K/V heads) each rank sends and receives in total over its group: (Hp, u·m)."""
        return self.padded, self.u * self.kv_per_rank
