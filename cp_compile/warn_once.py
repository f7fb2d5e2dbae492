"""WARNINGs given once per process and key, and the one way to forget them: :func:`reset_warnings`.

A compiled model is traced again on every recompile and at every graph break; the same WARNING each
time would bury the first. So the rewrite's repeated warnings (a graph with no attention, attention it
cannot split, a strategy's fallback, explicit mask rows, a low sharded share, an ``nn.MultiheadAttention``
left whole) go through :func:`warn_once`: a WARNING the first time its ``(kind, key)`` is met in this
process (``key``: usually the model source line), DEBUG after. :func:`reset_warnings` forgets them all,
so a test, or a user comparing two runs, sees each warning again (the tests call it before each test
and in each rank worker before each task: a verdict never depends on which test ran first).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, List, Set, Tuple

_GIVEN: Set[Tuple[str, Hashable]] = set()
_ALSO: List[Callable[[], None]] = []  # other per-process memories that decide a WARNING (kernel self-checks)


def warn_once(log: logging.Logger, kind: str, key: Hashable, msg: str, *args: Any) -> bool:
    """Log ``msg % args`` on ``log``: a WARNING the first time ``(kind, key)`` is seen in this process,
    DEBUG after. Returns whether this was the first time."""
    if (kind, key) in _GIVEN:
        log.debug(msg, *args)
        return False
    _GIVEN.add((kind, key))
    log.warning(msg, *args)
    return True


def reset_warnings() -> None:
    """Forget every warning given so far in this process, and the kernel self-check verdicts behind
    some of them (:mod:`cp_compile.kernels.self_check`): each is given again when next met."""
    _GIVEN.clear()
    for forget in _ALSO:
        forget()


def forget_with_warnings(forget: Callable[[], None]) -> None:
    """Have :func:`reset_warnings` also call ``forget`` (a memory whose verdict gives a WARNING)."""
    _ALSO.append(forget)


__all__ = ["forget_with_warnings", "reset_warnings", "warn_once"]
