"""Let AOTAutograd's cache serve ring_cp's rewritten graphs, keyed by cp_compile's source.

Why: with a warm Inductor cache, plain ``inductor`` skips AOTAutograd (tracing the
joint graph, partitioning, Inductor's joint-graph passes) by hitting the
AOTAutograd cache. ring_cp's graphs bypassed that cache, because they call the
autograd-aware helpers of :mod:`cp_compile.graph_ops` (``grad_all_reduce``, ...),
Python functions AOTAutograd cannot vouch for: their forward/backward is traced
into the compiled graphs, so a cached result is only valid for the code that
produced it. (Custom ops, ``torch.ops.cp_compile.*``, are accepted by torch as is.)

Fix: list exactly those helpers in Inductor's ``unsafe_marked_cacheable_functions``
with a hash of every ``.py`` file of the cp_compile package as their value. That
dict is part of Inductor's config, which is part of the AOTAutograd (and FX-graph)
cache key, so a cached graph is reused only by the same cp_compile source (the
custom ops' autograd and fake implementations included), the same torch, and the
same graph code, input metadata and config, as for any graph.

What is per rank stays out of the cached artifact: this rank's positions, orders
and padding masks are module buffers of the rewritten graph, which AOTAutograd
lifts to runtime inputs (read at every call), and the group name, world size and
options are literals of the graph code, hence of the key.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Dict

from .. import graph_ops

__all__ = ["aot_cache_config", "source_hash"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def source_hash(root: str = _PACKAGE) -> str:
    """SHA-256 over the relative path and bytes of every ``.py`` file under ``root``."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()


def aot_cache_config() -> Dict[str, Any]:
    """Inductor ``config_patches`` marking the graph helpers cacheable, keyed by :func:`source_hash`.

    Keeps whatever the user already marked. Pass it to ``compile_fx`` together with
    the other patches; AOTAutograd computes its cache key inside that call.
    """
    from torch._inductor import config

    marked = dict(config.unsafe_marked_cacheable_functions)
    key = f"cp_compile:{source_hash()}"
    marked.update({f"{fn.__module__}.{fn.__name__}": key for fn in graph_ops.GRAPH_FUNCTIONS})
    return {"unsafe_marked_cacheable_functions": marked}
