"""Under ``inputs="full"`` every CP rank must be passed the same batch: ranks given different
batches (a sampler over every rank instead of the DP ranks) all raise ``BatchMismatchError``
naming the input and the fix, instead of returning a loss mixed from the batches.

The check (``cp_compile/backend/batch_guard.py``) is one all-gather of fingerprints per call of a
rewritten graph; it is counted by wrapping ``batch_guard.gather_rows`` in the rank workers, never
timed. ``check_batch=False`` and ``inputs="local"`` issue none.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

import models

import cp_compile
from checks import AttentionCount, grad_errors, rel, ring_mismatches
from cp_compile.backend import batch_guard
from cp_compile.errors import BatchMismatchError

TOL = 1e-5
SMALL = dict(seq_len=32, n_layers=1)  # a 1-layer Llama, S=32: splits into 2N chunks for N=2 and 4
FIX = "DistributedSampler(num_replicas=dp_size, rank=dp_rank)"


@contextmanager
def _counting_gathers() -> Iterator[List[int]]:
    """In a rank worker: count the guard's collective ([calls so far]) while the block runs."""
    calls, gather = [0], batch_guard.gather_rows

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return gather(*args)

    batch_guard.gather_rows = counted
    try:
        yield calls
    finally:
        batch_guard.gather_rows = gather


def _catch(fn: Callable[[], Any]) -> Any:
    """(exception type, message), or None if ``fn`` returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message go back to the parent
        return type(e).__name__, str(e)
    return None


def _other_batch(seed: int):
    """(input_ids, labels) of the SMALL Llama drawn with another seed: a different batch."""
    return models.llama_factory(**SMALL, seed=seed)[1]


def _mismatches() -> Dict[str, Any]:
    with _counting_gathers() as calls:
        return _mismatches_counted(calls)


def _mismatches_counted(calls: List[int]) -> Dict[str, Any]:
    """On every rank: the same batch is exact with one check per call; different batches,
    different labels only, and a permutation of the same tokens each raise; the same batch again
    still runs (the ranks' collectives stay in step)."""
    rank = dist.get_rank()
    ref_model, (ids, labels) = models.llama_factory(**SMALL)
    cp_model, _ = models.llama_factory(**SMALL)
    with AttentionCount() as count:
        ref = ref_model(ids, labels)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp_model, backend=backend, fullgraph=True)
    out = compiled(ids, labels)
    out.backward()
    res: Dict[str, Any] = {"loss": rel(out.detach(), ref.detach()),
                           "grad": max(grad_errors(cp_model, ref_model).values()),
                           "rings": ring_mismatches(backend, count.calls), "gathers": calls[0]}
    perm = torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(1))  # (S,): the same tokens, moved
    cases = {
        "different": _other_batch(seed=rank),  # rank 0 keeps the batch, every other rank has its own
        "labels": (ids, labels if rank == 0 else _other_batch(seed=7)[1]),
        "permuted": (ids[:, perm], labels[:, perm]) if rank == dist.get_world_size() - 1 else (ids, labels),
    }
    for name, batch in cases.items():
        res[name] = _catch(lambda: compiled(*batch))
    res["again"] = rel(compiled(ids, labels).detach(), ref.detach())
    res["gathers_total"], res["graphs"] = calls[0], len(backend.graphs)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_given_different_batches_all_raise_naming_the_input_and_the_fix(ranks, world):
    for rank, res in enumerate(ranks.run(world, _mismatches, timeout=240)):
        assert res["loss"] <= TOL and res["grad"] <= TOL and not res["rings"], (rank, res)  # the same batch: exact
        assert res["gathers"] == 1, (rank, res)  # one collective for the one call
        for case in ("different", "labels", "permuted"):
            kind, msg = res[case]
            assert kind == BatchMismatchError.__name__ and FIX in msg and "inputs='local'" in msg, (rank, case, msg)
            assert "'labels'" in msg, (rank, case, msg)
        assert "'input_ids'" in res["different"][1] and "'input_ids'" in res["permuted"][1], res
        assert "'input_ids'" not in res["labels"][1], res["labels"]  # only the input that differs is named
        assert f"ranks [{world - 1}] differ from rank 0" in res["permuted"][1], res["permuted"]
        assert res["again"] <= TOL, (rank, res)  # after the errors the ranks are still in step
        assert res["graphs"] == 1 and res["gathers_total"] == 5, (rank, res)  # one per call, no recompile


def _decorated(check_batch: bool) -> Dict[str, Any]:
    with _counting_gathers() as calls:
        return _decorated_counted(check_batch, calls)


def _decorated_counted(check_batch: bool, calls: List[int]) -> Dict[str, Any]:
    """``@context_parallel(check_batch=...)`` around a step: the option reaches the backend."""
    ref_model, (ids, labels) = models.llama_factory(**SMALL)
    cp_model, _ = models.llama_factory(**SMALL)
    ref = ref_model(ids, labels)
    ref.backward()

    @cp_compile.context_parallel(inner="aot_eager", check_batch=check_batch)
    def step(model, input_ids, labels):
        loss = model(input_ids, labels)
        loss.backward()
        return loss

    out = step(cp_model, ids, labels)
    res = {"loss": rel(out.detach(), ref.detach()), "grad": max(grad_errors(cp_model, ref_model).values()),
           "gathers": calls[0], "records": len([r for r in step.backend.records if r.attention])}
    res["different"] = _catch(lambda: step(cp_model, *_other_batch(seed=dist.get_rank())))
    res["gathers_total"] = calls[0]
    return res


@pytest.mark.parametrize("check_batch", [True, False])
def test_check_batch_option_through_the_decorator(ranks, check_batch):
    """True (the default): one check per call, different batches raise. False: no collective at
    all, and different batches run (to a mixed loss, which is what the check is for)."""
    for rank, res in enumerate(ranks.run(2, _decorated, check_batch, timeout=240)):
        assert res["loss"] <= TOL and res["grad"] <= TOL and res["records"] == 1, (rank, res)
        if check_batch:
            assert res["gathers"] == 1 and res["gathers_total"] == 2, (rank, res)
            assert res["different"][0] == BatchMismatchError.__name__ and FIX in res["different"][1], res
        else:
            assert res["gathers"] == 0 and res["gathers_total"] == 0 and res["different"] is None, (rank, res)


def _local_inputs() -> Dict[str, Any]:
    """``inputs="local"``: each rank passes its own shard (they differ by design): no check."""
    with _counting_gathers() as calls:
        return _local_inputs_counted(calls)


def _local_inputs_counted(calls: List[int]) -> Dict[str, Any]:
    ref_model, (ids, labels) = models.llama_factory(**SMALL)
    cp_model, _ = models.llama_factory(**SMALL)
    ref = ref_model(ids, labels)
    local = (cp_compile.shard(ids, 1), cp_compile.shard(labels, 1))
    backend = cp_compile.RingCP(inner="aot_eager", inputs="local")
    out = torch.compile(cp_model, backend=backend, dynamic=True)(*local)
    return {"loss": rel(out.detach(), ref.detach()), "gathers": calls[0], "graphs": len(backend.graphs)}


@pytest.mark.slow
def test_local_inputs_are_not_checked(ranks):
    for rank, res in enumerate(ranks.run(2, _local_inputs, timeout=240)):
        assert res["loss"] <= TOL and res["graphs"] == 1 and res["gathers"] == 0, (rank, res)


def test_fingerprint_sees_every_change_on_any_dtype_and_strides():
    """One process: equal tensors agree whatever their strides; a changed element, a swap of two
    elements, or a shuffle changes the fingerprint; bool, float and integer dtypes all work."""
    def fp(t: torch.Tensor) -> int:
        return int(batch_guard.fingerprint(t, batch_guard.position_weights(t.numel(), t.device)))

    w = batch_guard.position_weights(200, torch.device("cpu"))
    assert torch.equal(w[:128], batch_guard.position_weights(128, torch.device("cpu")))  # the cache serves prefixes
    assert bool((w % 2 != 0).all()) and w.unique().numel() == 200  # odd, distinct
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 64), generator=g)
    assert fp(ids) == fp(ids.t().contiguous().t()) == fp(ids.clone())  # strides do not matter
    swapped = ids.clone()
    swapped[0, [3, 9]] = swapped[0, [9, 3]]
    changed = ids.clone()
    changed[1, 5] += 1
    seen = {fp(ids), fp(swapped), fp(changed), fp(ids[:, torch.randperm(64, generator=g)]), fp(ids.roll(1, 1))}
    assert len(seen) == 5
    for x in (torch.randn(2, 64, 8, generator=g), torch.rand(2, 64, generator=g) < 0.5,
              torch.randn(2, 64, generator=g).to(torch.bfloat16), torch.randn(2, 64, 4, generator=g)[..., 1]):
        y = x.clone()
        y.view(-1)[7] = ~y.view(-1)[7] if y.dtype == torch.bool else y.view(-1)[7] + 1
        assert fp(x) == fp(x.clone()) and fp(x) != fp(y), x.dtype


def _raised(monkeypatch, tensors, edit) -> str:
    """One process, the all-gather replaced by the rows 2 ranks would send: rank 1's row is this
    rank's with ``edit(row)`` applied. The message raised, or "" if none."""
    def two_ranks(mine: torch.Tensor, group: Any) -> torch.Tensor:  # (2, ROW)
        other = mine.clone()
        edit(other)
        return torch.stack([mine, other])

    monkeypatch.setattr(batch_guard, "gather_rows", two_ranks)
    try:
        batch_guard.check_same_batch(tensors, batch_guard.RingGroup(None, 0, 2), {})
    except BatchMismatchError as e:
        return str(e)
    return ""


def test_message_names_shapes_contents_graphs_and_only_what_differs(monkeypatch):
    ids, labels = torch.zeros(2, 64, dtype=torch.int64), torch.ones(2, 64, dtype=torch.int64)
    batch = [(ids, "input_ids"), (labels, "labels")]
    prints = 2 + batch_guard.SHAPE_DIMS * batch_guard.MAX_INPUTS  # where the fingerprints start in a row
    assert _raised(monkeypatch, batch, lambda row: None) == ""

    def longer(row):
        row[3] = 96  # input_ids (2, 96) on rank 1

    msg = _raised(monkeypatch, batch, longer)
    assert "'input_ids' (ranks [1] differ from rank 0 in shapes rank 0 (2, 64), rank 1 (2, 96))" in msg, msg
    assert "'labels'" not in msg and FIX in msg, msg

    def other_labels(row):
        row[prints + 1] += 1

    msg = _raised(monkeypatch, batch, other_labels)
    assert "'labels' (ranks [1] differ from rank 0 in contents)" in msg and "'input_ids'" not in msg, msg

    def other_graph(row):
        row[0] = 3  # rank 1's graph checks three inputs

    assert "the ranks compiled different graphs" in _raised(monkeypatch, batch, other_graph)
    many = [(torch.full((2, 8), i), f"x{i}") for i in range(10)]  # more inputs than a row describes one by one

    def last_differs(row):
        row[prints + batch_guard.MAX_INPUTS - 1] += 1

    msg = _raised(monkeypatch, many, last_differs)
    assert "'x7, x8, x9' (ranks [1] differ from rank 0 in contents)" in msg, msg
    assert batch_guard.describe(many, torch.arange(10)).shape == (batch_guard.ROW,)


def test_guard_skips_activations_and_fake_tensors(monkeypatch):
    """Inputs that require a gradient (activations of earlier code) and fake tensors (DDPOptimizer
    runs pieces on them at compile time) are not checked; other tensor inputs are, by position."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    checked: List[List[str]] = []
    monkeypatch.setattr(batch_guard, "check_same_batch", lambda ts, g, c: checked.append([n for _, n in ts]))
    group = cp_compile.group.CPGroup(pg=None, rank=0, size=2)
    run = batch_guard.guard_same_batch(lambda *a: len(a), group, [(0, "input_ids"), (2, "hidden"), (3, "n")])
    ids, hidden = torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, 4, requires_grad=True)
    assert run(ids, torch.zeros(3), hidden, 8) == 4  # the compiled function still runs, with every argument
    assert checked == [["input_ids"]]  # not the activation, not the int
    with FakeTensorMode() as mode:
        run(mode.from_tensor(ids), torch.zeros(3), hidden, 8)
    assert checked == [["input_ids"]]
