"""The exceptions cp_compile raises, in one place. Each message names the fix.

* :class:`CPRewriteError` — the graph cannot be made context-parallel as asked (bad input,
  an unsupported pattern, or ``strict=True`` where the rewrite would gather);
* :class:`RingCommError` — a ring transfer or collective failed or timed out (names the
  peer, the step and the direction);
* ``ValueError`` — an option or a ring-op argument out of its documented range.
"""

from __future__ import annotations


class CPRewriteError(RuntimeError):
    """The graph cannot be made context-parallel as asked; the message names the fix."""


from .ring.faults import RingCommError  # noqa: E402  (defined with the ring's fault handling)

__all__ = ["CPRewriteError", "RingCommError"]
