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

# No GPU here: the Triton kernels run under Triton's interpreter. It is chosen when a
# kernel is decorated, so the variable is set before anything imports them; the
# spawned rank workers inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# tests/ has no __init__.py: pytest (rootdir, prepend import mode) puts tests/ on
# sys.path, which the spawned workers inherit, so this and the test modules import
# as top-level modules there too.
from distributed import RankPools


@pytest.fixture(scope="session")
def ranks():
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()
