"""The exceptions cp_compile raises, in one place. Each message names the fix.

* :class:`CPRewriteError` — the graph cannot be made context-parallel as asked (bad input,
  an unsupported pattern, or ``strict=True`` where the rewrite would gather);
* :class:`BatchMismatchError`, a CPRewriteError — under ``inputs="full"`` the ranks of the
  CP group were given different batches (``check_batch``, :mod:`.backend.batch_guard`);
* :class:`RingCommError` — a ring transfer or collective failed or timed out (names the
  peer, the step and the direction);
* ``ValueError`` — an option or a ring-op argument out of its documented range.
"""

from __future__ import annotations


class CPRewriteError(RuntimeError):
    """The graph cannot be made context-parallel as asked; the message names the fix."""


class BatchMismatchError(CPRewriteError):
    """The CP ranks were passed different values of an input the graph shards (different batches
    where ``inputs="full"`` needs the same one); raised on every rank; the message names the input
    and the fix."""


from .ring.faults import RingCommError  # noqa: E402  (defined with the ring's fault handling)

__all__ = ["BatchMismatchError", "CPRewriteError", "RingCommError"]
