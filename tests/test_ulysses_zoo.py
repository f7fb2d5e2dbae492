"""Zoo members under the Ulysses and 2-D strategies (``RingCP(strategy=...)``), on real gloo ranks.

Two members whose attention forms differ from tests/test_ulysses.py's run, ``nn_encoder`` under
``strategy="ulysses"`` at N = 2 and ``t5_encoder`` under ``strategy="2d", ulysses_degree=2`` at N = 4
(2 x 2), measured on every rank by :func:`zoo.measure.measure` (``examples/zoo_sweep.py --strategy ...``
runs all twenty under each strategy: docs/zoo.md):

* ``t5_encoder``: a learned bucketed relative bias ``table[bucket(kv - q), h]`` (a score rule reading
  the head: under Ulysses the local head is mapped to the global one, and the table's gradient is
  shared over the ranks holding each head), plus a padding mask;
* ``nn_encoder``: ``nn.TransformerEncoder`` (the fused MHA path, ``(S, B, E)``), bidirectional, with a
  key padding mask.

Required, as for the ring (tests/test_zoo.py): the loss and every parameter gradient within the
member's tolerance (1e-5 relative) of the eager one-process run, no gradient on one side only,
every attention a ring op and no other attention or sequence-squared tensor on a second call,
exactly the member's declared gather fallbacks, and ``cp-compile explain``'s record = the runtime's;
and here: every ring op got the strategy asked for (its description's ``strategy`` / ``ulysses``),
none left on the ring, with its q, k and v all-to-alls in the graph.
"""

from __future__ import annotations

import pytest

from checks import zoo_problems
from zoo import members
from zoo.measure import measure

ZOO = members()


def _measure_all(names, options):
    """On each rank: :func:`measure` of every member in ``names`` under backend ``options``."""
    return {name: measure(name, **options) for name in names}


def _problems(name: str, r: dict, expected: str) -> list:
    """What fails for one member on one rank (empty: every check holds): tests/test_zoo.py's checks, and
    every attention under the strategy asked for, with its q, k, v all-to-alls."""
    bad = zoo_problems(ZOO[name], r, sharded=False)
    if not r["strategies"] or set(r["strategies"]) != {expected} or r["not_applied"]:
        bad.append(f"strategies {r['strategies']} (expected {expected}), left on the ring {r['not_applied']}")
    if r["a2a"] < 3 * len(r["strategies"]):
        bad.append(f"{r['a2a']} seq_to_heads for {len(r['strategies'])} attention(s): q, k, v each need one")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("world,names,options,expected", [  # one member per strategy: the suite's time
    pytest.param(2, ("nn_encoder",), {"strategy": "ulysses"}, "ulysses u=2", id="ulysses-N2"),
    pytest.param(4, ("t5_encoder",), {"strategy": "2d", "ulysses_degree": 2}, "2d u=2 x r=2", id="2d-N4"),
])
def test_zoo_members_exact_under_the_strategy(ranks, world, names, options, expected):
    per_rank = ranks.run(world, _measure_all, names, options, timeout=300)
    failures = {(name, rank): p for rank, got in enumerate(per_rank) for name, r in got.items()
                if (p := _problems(name, r, expected))}
    assert not failures, f"{options} on {world} ranks: {failures}"
