"""A reusable multi-process gloo harness for tests.

Spawning a process and importing torch costs seconds, so workers are not started per
test: :class:`RankPools` keeps one persistent :class:`RankPool` per world size, created
on first use and reused for the whole pytest session (see the ``ranks`` fixture in
``conftest.py``)::

    def _sum_ranks():                      # module level, so it pickles by reference
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return t

    def test_sum(ranks):
        results = ranks.run(2, _sum_ranks)  # one return value per rank, index = rank

Rules for ``fn``:

* it must be a module-level function (pickled by reference; the workers import its
  module: pytest puts ``tests/`` on ``sys.path`` and spawn hands ``sys.path`` to the
  children), and its arguments must be picklable;
* it runs on every rank of an initialised gloo process group (``dist.get_rank()``,
  ``dist.get_world_size()``, ``dist.group.WORLD``), one torch thread per worker,
  with ``CP_COMPILE_TEST_WORKER=1`` in the environment;
* its return value must be picklable. Tensors anywhere inside lists / tuples / dicts
  are detached and moved to CPU, then copied *by value* (plain pickle, not shared
  memory), so the caller gets independent tensors.

Failure handling: if any rank raises, :meth:`RankPools.run` raises
:class:`RankError` (an ``AssertionError``) carrying every failing rank's traceback.
If results do not arrive within ``timeout`` seconds (a hang: e.g. one rank returned
or raised while its peers wait in a collective), it raises :class:`RankTimeout`
naming the ranks that did not answer. After either, the pool for that world size is
terminated and discarded — its process group may be stuck or inconsistent — and the
next run for that world size starts a fresh pool.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["RankError", "RankPool", "RankPools", "RankTimeout"]

_READY = "__ready__"  # task id of the handshake a worker sends after init_process_group
_POLL = 0.2  # seconds between liveness checks while waiting for results
_ERROR_GRACE = 3.0  # after one rank fails, how long to wait for the others' results
_START_TIMEOUT = 180.0  # spawn + import torch + init_process_group, per attempt
_START_ATTEMPTS = 3  # a fresh port each attempt (the free port can be taken meanwhile)


class RankError(AssertionError):
    """One or more ranks raised (or died) while running a function."""


class RankTimeout(RankError, TimeoutError):
    """Some ranks did not answer in time; most likely a hang in a collective."""


# --------------------------------------------------------------------------- workers


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(value: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    def leaf(x):
        return x.detach().cpu() if isinstance(x, torch.Tensor) else x

    return tree_map(leaf, value)


def _worker(rank: int, world_size: int, init_method: str, tasks, results) -> None:
    """Worker main loop: init the gloo group, then run tasks until the sentinel."""
    os.environ["CP_COMPILE_TEST_WORKER"] = "1"
    parent = os.getppid()
    try:
        import torch
        import torch.distributed as dist

        import cp_compile
        from mutations import from_env

        from_env()  # (benchmarks/mutation_check.py only: a rule switched off in this worker too)
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=10),
        )
    except BaseException:
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    results.put((_READY, rank, True, None))

    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned: the test session is gone
                return
            continue
        if item is None:  # sentinel: orderly shutdown
            break
        task_id, payload = item
        try:
            torch._dynamo.reset()  # every task compiles from a clean Dynamo, whatever ran before it
            cp_compile.reset_warnings()  # and sees cp_compile's once-per-process WARNINGs again
            fn, args, kwargs = pickle.loads(payload)
            value = pickle.dumps(_to_cpu(fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
            results.put((task_id, rank, True, value))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # Skip interpreter teardown (slow with torch loaded; seconds on a busy machine):
    # every answer has been read by the parent, flush what is left and leave.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- pools


class RankPool:
    """``world_size`` persistent worker processes forming one gloo process group."""

    def __init__(self, world_size: int, ctx=None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._ctx = ctx or mp.get_context("spawn")
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._next_id = 0
        self.broken = False
        self._stop_sent = False
        errors = []
        for _ in range(_START_ATTEMPTS):
            try:
                err = self._start()
            except BaseException:
                self.close(graceful=False)
                raise
            if err is None:
                return
            errors.append(err)
            self.close(graceful=False)
        raise RuntimeError(
            f"could not start a {world_size}-rank gloo pool:\n" + "\n".join(errors)
        )

    def _start(self) -> str | None:
        """Spawn the workers and wait for every rank's handshake; an error text or None."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.broken = self._stop_sent = False
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_method, self._tasks[r], self._results),
                name=f"cp-test-rank{r}-of{self.world_size}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        answers, missing = self._collect(_READY, _START_TIMEOUT, grace=_ERROR_GRACE)
        failed = {r: tb for r, (ok, tb) in answers.items() if not ok}
        if not failed and not missing:
            return None
        parts = [f"rank {r} failed to initialise:\n{tb}" for r, tb in sorted(failed.items())]
        if missing:
            parts.append(f"ranks {sorted(missing)} did not initialise in time")
        return "\n".join(parts)

    def _collect(self, task_id, timeout: float, grace: float):
        """Gather answers for ``task_id``: ({rank: (ok, payload)}, set of missing ranks).

        Stops at ``timeout``; once any rank has failed, waits at most ``grace`` more
        seconds for the rest. A rank whose process died counts as failed.
        """
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                tid, rank, ok, payload = self._results.get(timeout=min(_POLL, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if r not in answers and not p.is_alive()]
                if dead:
                    # A worker that exits after answering (e.g. a failed init) may
                    # still have its answer in flight: read those first.
                    self._drain(task_id, answers, wait=0.5)
                    for r in dead:
                        if r not in answers:
                            code = self._procs[r].exitcode
                            answers[r] = (False, f"worker process died (exit code {code})\n")
                if any(not ok for ok, _ in answers.values()):
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            if tid != task_id:  # stale answer of an earlier task; cannot normally happen
                continue
            answers[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + grace)
        missing = set(range(self.world_size)) - set(answers)
        return answers, missing

    def _drain(self, task_id, answers: dict, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            try:
                tid, rank, ok, payload = self._results.get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                return
            if tid == task_id:
                answers[rank] = (ok, payload)

    def run(self, fn: Callable, args=(), kwargs=None, timeout: float = 120.0) -> list:
        if self.broken:
            raise RuntimeError("this pool was discarded after an earlier failure")
        task_id = self._next_id
        self._next_id += 1
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for q in self._tasks:
                q.put((task_id, payload))
            answers, missing = self._collect(task_id, timeout, grace=_ERROR_GRACE)
        except BaseException:  # e.g. pytest-timeout or Ctrl-C while waiting
            self.broken = True
            raise
        name = getattr(fn, "__qualname__", repr(fn))
        failed = {r: tb for r, (ok, tb) in answers.items() if not ok}
        if failed or missing:
            self.broken = True
            if not failed:
                raise RankTimeout(
                    f"{name} timed out after {timeout:g} s on world size {self.world_size}: "
                    f"ranks {sorted(missing)} did not answer (hang in a collective?)"
                )
            parts = [f"{name} failed on ranks {sorted(failed)} of world size {self.world_size}"]
            parts += [f"\n----- rank {r} -----\n{tb}" for r, tb in sorted(failed.items())]
            if missing:
                parts.append(
                    f"\nranks {sorted(missing)} did not answer within {_ERROR_GRACE:g} s "
                    "of the failure (waiting in a collective?)"
                )
            raise RankError("\n".join(parts))
        return [pickle.loads(answers[r][1]) for r in range(self.world_size)]

    def request_stop(self) -> None:
        """Send every worker the shutdown sentinel (without waiting)."""
        if not self.broken and not self._stop_sent:
            self._stop_sent = True
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:
                    pass

    def close(self, graceful: bool = True, join_timeout: float = 3.0) -> None:
        """Stop the workers: sentinel + join if graceful, then terminate / kill stragglers."""
        if graceful and not self.broken:
            self.request_stop()
            deadline = time.monotonic() + join_timeout
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()  # never block on a feeder thread to a dead worker
                q.close()
        self._procs, self._tasks, self._results = [], [], None
        self.broken = True


class RankPools:
    """One lazily created :class:`RankPool` per world size, reused across tests."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}
        self._ctx = mp.get_context("spawn")
        atexit.register(self.close)

    def run(self, world_size: int, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group.

        Returns the list of return values, index = rank. Raises :class:`RankError` if a
        rank raised and :class:`RankTimeout` if ranks did not answer within ``timeout``
        seconds; either way the pool is discarded and the next call starts a fresh one.
        """
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size, self._ctx)
        try:
            return pool.run(fn, args, kwargs, timeout=timeout)
        finally:
            if pool.broken:
                self._pools.pop(world_size, None)
                pool.close(graceful=False)

    def close(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():  # all pools shut down in parallel
            pool.request_stop()
        for pool in pools.values():
            pool.close()
