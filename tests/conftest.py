"""Shared fixtures.

``ranks`` runs a module-level function on every rank of a gloo process group, using
persistent worker pools (one per world size) that live for the whole session; see
``tests/distributed.py`` for the rules and failure behaviour::

    def _work(x):
        ...  # runs on each rank; torch.distributed is initialised (gloo)
        return result  # picklable; tensors come back detached, on CPU

    def test_something(ranks):
        per_rank = ranks.run(2, _work, x, timeout=60)  # list indexed by rank
"""

from __future__ import annotations

import os
import sys

# The example models (examples/models.py, examples/model_styles.py, ...) import as top-level
# modules in every test module and, through the inherited sys.path, in the rank workers.
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

# No GPU here: the Triton kernels run under Triton's interpreter. It is chosen when a
# kernel is decorated, so the variable is set before anything imports them; the
# spawned rank workers inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# tests/ has no __init__.py: pytest (rootdir, prepend import mode) puts tests/ on
# sys.path, which the spawned workers inherit, so this and the test modules import
# as top-level modules there too.
from distributed import RankPools  # noqa: E402 (after the sys.path and TRITON_INTERPRET set-up)
from mutations import from_env  # noqa: E402  (benchmarks/mutation_check.py only: a rule switched off)

from_env()


# Test tiers: ``./dev test`` runs everything (CI); ``--fast`` (``-m "not slow and not inductor"``) is
# the inner loop; ``--unit`` (``-m "not multirank and not slow and not inductor"``) starts no process
# group. ``slow`` and ``inductor`` are marked on the tests themselves (``@pytest.mark.slow``): slow is
# a test one of whose cases took 5 s or more in a full run on 2 busy cores (the durations record in
# docs/examples.md, which tests/test_harness.py checks the marks against), except the smoke tests it
# names; and a single-process one whose case took about 3 s or more in a ``--unit`` run on 2 cores
# loaded ~5x over (so that ``--unit`` stays under a minute of CPU).
# ``multirank`` is set here, from the fixture.


def pytest_collection_modifyitems(config, items):
    """Mark ``multirank`` every test that starts rank processes (it uses the ``ranks`` fixture)."""
    for item in items:
        if "ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multirank)


@pytest.fixture(scope="session")
def ranks():
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Every test sees cp_compile's once-per-process WARNINGs again (rank workers reset them per task)."""
    import cp_compile

    cp_compile.reset_warnings()
    yield
