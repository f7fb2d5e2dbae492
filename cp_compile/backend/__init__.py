"""The ``ring_cp`` backend: what Dynamo calls, and what the compiled graphs need at run time.

* :mod:`.compiler` — :class:`RingCP` (the backend object; ``backend="ring_cp"`` resolves to
  :func:`ring_cp`) and :func:`rewrite_for_cp`, which runs the passes of :mod:`cp_compile.passes`
  and hands the rewritten graph to the inner compiler;
* :mod:`.record` — what each graph got (a :class:`GraphRecord`), shared with ``cp-compile
  explain``; :mod:`.cost` counts the collectives and activation bytes a rewritten graph costs;
* :mod:`.schedule` — overlap of the gradient all-reduces with the backward (Inductor config);
* :mod:`.aot_cache` — lets rewritten graphs hit Inductor's AOTAutograd cache;
* :mod:`.eager_guard`, :mod:`.local_guard` — run-time checks of gradient shares and of
  per-rank inputs under ``inputs="local"``.
"""

from ..options import INNER, BackendOptions
from .compiler import RingCP, ring_cp, rewrite_for_cp

__all__ = ["INNER", "BackendOptions", "RingCP", "ring_cp", "rewrite_for_cp"]
