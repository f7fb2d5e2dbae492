"""The multi-process gloo harness itself (tests/distributed.py, ``ranks`` fixture)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distributed import RankError, RankTimeout


def _all_reduce_rank_plus_one(shape):
    t = torch.full(shape, float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "worker_env": os.environ.get("CP_COMPILE_TEST_WORKER"),
    }


def _fail_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return dist.get_rank()


def _recv_never_sent():
    if dist.get_rank() == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1)  # rank 1 never sends: rank 0 hangs here
    return dist.get_rank()


def _rank():
    return dist.get_rank()


def _grad_tensor():
    x = torch.ones(3, requires_grad=True)
    return (x * 2, [x.sum()])  # non-leaf tensors requiring grad come back detached


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_sums_over_ranks(ranks, world_size):
    out = ranks.run(world_size, _all_reduce_rank_plus_one, (2, 3))
    expected = float(sum(r + 1 for r in range(world_size)))
    assert [o["rank"] for o in out] == list(range(world_size))
    assert len({o["pid"] for o in out}) == world_size
    for o in out:
        assert o["world"] == world_size
        assert o["threads"] == 1
        assert o["worker_env"] == "1"
        torch.testing.assert_close(o["sum"], torch.full((2, 3), expected))


def test_pool_is_reused(ranks):
    first = ranks.run(2, _all_reduce_rank_plus_one, (1,))
    second = ranks.run(2, _all_reduce_rank_plus_one, (1,))
    assert [o["pid"] for o in first] == [o["pid"] for o in second]


def test_returned_tensors_are_detached_cpu_copies(ranks):
    (a, [b]), = ranks.run(1, _grad_tensor)
    assert not a.requires_grad and a.device.type == "cpu"
    torch.testing.assert_close(a, torch.full((3,), 2.0))
    torch.testing.assert_close(b, torch.tensor(3.0))


@pytest.mark.slow
def test_exception_names_rank_and_pool_recovers(ranks):
    with pytest.raises(AssertionError) as info:
        ranks.run(2, _fail_on, 1)
    msg = str(info.value)
    assert isinstance(info.value, RankError)
    assert "rank 1" in msg and "deliberate failure on rank 1" in msg
    assert "ValueError" in msg and "rank 0 -----" not in msg
    assert ranks.run(2, _rank) == [0, 1]


@pytest.mark.slow
def test_hang_times_out_and_pool_recovers(ranks):
    """A hang is reported as RankTimeout once this call's own timeout has passed, naming
    the rank that hung, and the next call gets a fresh pool. The message says which
    timeout fired (5 s, not the 120 s default); how long it took is not asserted."""
    ranks.run(2, _rank)  # make sure the pool exists, so the 5 s go to the hang only
    with pytest.raises(RankTimeout) as info:
        ranks.run(2, _recv_never_sent, timeout=5)
    msg = str(info.value)
    assert "_recv_never_sent timed out after 5 s on world size 2" in msg, msg
    assert "ranks [0] did not answer" in msg, msg  # rank 0 hung; rank 1 returned
    assert ranks.run(2, _rank) == [0, 1]


def _exit_on(bad_rank):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


@pytest.mark.slow
def test_dead_worker_is_reported_and_pool_recovers(ranks):
    with pytest.raises(RankError, match=r"rank 1 -----\nworker process died \(exit code 3\)"):
        ranks.run(2, _exit_on, 1, timeout=30)
    assert ranks.run(2, _rank) == [0, 1]


def test_no_per_call_budget_exceeds_the_suite_timeout():
    """No ``timeout=`` given to a rank call or a subprocess in tests/ exceeds pytest's own per-test
    timeout (pyproject.toml): a longer budget could never be reached (pytest stops the test first)."""
    import re
    import tomllib

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(os.path.dirname(here), "pyproject.toml"), "rb") as f:
        suite = tomllib.load(f)["tool"]["pytest"]["ini_options"]["timeout"]
    over = []
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name)) as f:
                over += [f"{name}: timeout={t}" for t in re.findall(r"\btimeout=(\d+(?:\.\d+)?)\b", f.read())
                         if float(t) > suite]
    assert not over, f"budgets above the suite's {suite} s timeout: {over}"


SLOW_SECONDS = 5.0  # a case this slow in the record is out of the fast tier (tests/conftest.py)
SMOKE = {  # kept in the fast tier on purpose, however long they take
    "tests/test_hf_architectures.py::test_architecture_has_its_outcome": "the fast tier's end-to-end HF model run",
}


@pytest.mark.slow
def test_slow_marks_follow_the_durations_record():
    """Every test the committed durations record (docs/examples.md, written by benchmarks/durations.py)
    times at SLOW_SECONDS or more is outside ``./dev test --fast`` now (pytest's own collection), except
    the SMOKE tests."""
    import importlib.util
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("durations", os.path.join(root, "benchmarks", "durations.py"))
    durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(durations)
    with open(os.path.join(root, "docs", "examples.md")) as f:
        record = f.read().split(durations.BEGIN)[1].split(durations.END)[0]
    rows = [(float(s), t) for s, t in re.findall(r"^\| ([\d.]+) \| \w+ \| `([^`]+)` \|$", record, re.M)]
    assert len(rows) >= 40, f"the record in docs/examples.md lists {len(rows)} tests"
    fast = durations.fast_ids({t.split("::")[0] for _, t in rows})
    assert fast, "pytest collected no fast test from the record's files"
    unmarked = [f"{t} ({s:.1f} s)" for s, t in rows if s >= SLOW_SECONDS and t in fast and t not in SMOKE]
    assert not unmarked, f"in the fast tier, but {SLOW_SECONDS} s or more in the record: mark them slow: {unmarked}"
