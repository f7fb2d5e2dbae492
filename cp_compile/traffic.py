"""Bytes this process sends over the CP group, counted where they are sent (measurement, not a model).

The ring's hops (:mod:`cp_compile.ring.comm`) and the Ulysses all-to-alls
(:mod:`cp_compile.ulysses.ops`) add what they send while a :func:`measure` block is open; the cost
model (:mod:`cp_compile.ulysses.cost`) and ``cp-compile plan`` are checked against these counts::

    with cp_compile.traffic.measure() as sent:
        loss = model(x); loss.backward()
    sent  # {"ring K/V": 65536, "ring dK/dV": 131072, "all_to_all": 49152}

Outside a block nothing is counted (one dict lookup per send). Bytes sent to oneself (an
all-to-all's own slice) are not counted.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

_OPEN: List[Dict[str, int]] = []


def add(kind: str, nbytes: int) -> None:
    """Count ``nbytes`` sent as ``kind`` in every open :func:`measure` block."""
    for counts in _OPEN:
        counts[kind] = counts.get(kind, 0) + int(nbytes)


@contextlib.contextmanager
def measure() -> Iterator[Dict[str, int]]:
    """A dict of bytes sent by kind, filled while the block runs."""
    counts: Dict[str, int] = {}
    _OPEN.append(counts)
    try:
        yield counts
    finally:
        _OPEN.remove(counts)
