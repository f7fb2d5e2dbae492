"""The two sub-groups of a 2-D (Ulysses x ring) CP group.

A CP group of ``N = u·r`` ranks is read as an ``r x u`` grid, CP rank ``k = i·u + j``: the
**Ulysses group** of rank k is its row (CP ranks ``i·u .. i·u + u - 1``: consecutive ranks, one
node's GPUs under the usual rank order), its **ring group** its column (CP ranks ``j, u + j, ...``)::

    N = 4, u = 2:   Ulysses groups {0, 1} {2, 3}      ring groups {0, 2} {1, 3}

With zig-zag over N this composes: the u ranks of a row together hold chunks ``i·u .. i·u+u-1``
and their mirror images, which are rank i's two chunks of zig-zag over r (contiguous likewise), so
the ring over a column runs the plain r-rank layout on the row's tokens put in order.

Sub-groups are created once per (CP group, u), with ``use_local_synchronization`` (only the
members call ``new_group``, so DP x CP meshes need no world-wide agreement on the order), and
cached. A synthetic group (``pg=None``, what ``cp-compile explain`` rewrites for) gets synthetic
names: its graph is read, never run.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch.distributed as dist

from ..group import CPGroup

_CACHE: Dict[Tuple[str, int, int], Tuple[CPGroup, CPGroup]] = {}


def check_degree(u: int, world: int) -> None:
    """Raise a ValueError naming the fix unless ``u`` divides the CP group's size."""
    if not isinstance(u, int) or isinstance(u, bool) or u < 1 or world % u:
        raise ValueError(f"cp_compile: ulysses_degree={u!r} does not divide the CP group's {world} ranks. "
                         f"Fix: pass a divisor of {world} (e.g. the GPUs of one node), or strategy='ring'.")


def grid_position(rank: int, u: int) -> Tuple[int, int]:
    """(i, j): the ring index (row) and Ulysses index (column) of CP rank ``rank``."""
    return rank // u, rank % u


def sub_groups(cp: CPGroup, u: int) -> Tuple[CPGroup, CPGroup]:
    """(Ulysses group, ring group) of this rank for degree ``u``; a group of one rank is ``pg=None``."""
    check_degree(u, cp.size)
    i, j = grid_position(cp.rank, u)
    r = cp.size // u
    if cp.pg is None:  # a synthetic group: names only (the graph is read, not run)
        return (CPGroup(None, j, u) if u > 1 else CPGroup(None, 0, 1),
                CPGroup(None, i, r) if r > 1 else CPGroup(None, 0, 1))
    key = (cp.name, id(cp.pg), u)  # a group re-made under the same name (re-initialised) is another key
    if key not in _CACHE:
        members = dist.get_process_group_ranks(cp.pg)  # CP rank -> global rank
        row = [members[i * u + jj] for jj in range(u)]
        col = [members[ii * u + j] for ii in range(r)]
        _CACHE[key] = (_make(row, j), _make(col, i))
    return _CACHE[key]


def _make(ranks: list, me: int) -> CPGroup:
    if len(ranks) == 1:
        return CPGroup(None, 0, 1)
    pg = dist.new_group(ranks, use_local_synchronization=True)
    return CPGroup(pg, me, len(ranks))


def synthetic_name(kind: str, cp: CPGroup, u: int) -> str:
    """The name a synthetic group's sub-group is shown under (``cp-compile explain``)."""
    i, j = grid_position(cp.rank, u)
    where = f"row {i}" if kind == "ulysses" else f"column {j}"
    return f"<{kind} group of CP rank {cp.rank}: {where}>"
