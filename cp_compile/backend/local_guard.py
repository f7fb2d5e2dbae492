"""Under ``outputs="local"``: refuse a graph that receives another ring_cp graph's shard.

With ``outputs="local"`` (and ``inputs="full"``) a rewritten graph returns this rank's
shard of each sequence output, for a training loop that works on shards. When
Dynamo splits the model into several graphs (a graph break), the next graph would
receive that shard as if it were the whole sequence: a graph with attention would
split it again and attend over a sequence made of every rank's pieces, a graph
without attention would reduce over this rank's tokens only (a loss that is this
rank's mean). Both silently wrong, so the guard tags the tensors a graph returns as
shards, and every graph of such a backend refuses tagged inputs on its first call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..passes.context import CPRewriteError

_TAG = "_cp_compile_local_shard"


def guard_local_shards(compiled: Callable, local_outputs: Sequence[int], input_names: Sequence[str]) -> Callable:
    """``compiled`` that tags its outputs at ``local_outputs`` (flat positions) as local
    shards, and refuses, on its first call, any input that carries that tag (``input_names``:
    the graph inputs' names, for the message)."""
    checked = False

    def run(*args: Any) -> Any:
        nonlocal checked
        if not checked:
            checked = True
            shards = [input_names[i] if i < len(input_names) else f"#{i}" for i, a in enumerate(args)
                      if isinstance(a, torch.Tensor) and getattr(a, _TAG, False)]
            if shards:
                raise CPRewriteError(
                    f"cp_compile: outputs='local', and inputs {shards} of this graph are this rank's shards returned "
                    "by another ring_cp graph: Dynamo split the model (a graph break) where a sequence value "
                    "crosses from one graph to the next. This graph would take each shard for the whole sequence "
                    "(split it again, or reduce over this rank's tokens only). Fix: remove the graph break "
                    "(torch.compile(..., fullgraph=True) shows where it is), or use outputs='full'."
                )
        out = compiled(*args)
        if local_outputs and isinstance(out, (tuple, list)):
            for i in local_outputs:
                if i < len(out) and isinstance(out[i], torch.Tensor):
                    setattr(out[i], _TAG, True)
        return out

    return run
