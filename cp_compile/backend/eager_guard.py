"""Under ``grad_sync="none"``: refuse parameters that eager code used before a ring_cp graph.

ring_cp leaves each rank a CP *share* of the gradient of every parameter its graphs
use, and DDP/FSDP sums the shares over the CP ranks. A parameter used by code that
Dynamo runs eagerly never reaches ring_cp: every rank computes its *full* gradient,
and the sum over cp makes it cp times too large. The usual cause is per-layer
``fully_shard`` (or any graph break inside a loop): Dynamo then runs the model's own
forward eagerly and compiles only the modules it calls that have Python frames of
their own, not built-in ones such as ``nn.Embedding`` or ``nn.Linear``.

The check runs once per compiled graph, on its first real call with grad mode on:
it walks the autograd history of the graph's inputs that need a gradient back to
the nearest compiled graphs (``CompiledFunctionBackward``: what AOTAutograd makes of
every graph compiled with Inductor or aot_eager, so not with ``inner="eager"``).
An ``nn.Parameter`` met on the way was used eagerly, and is refused. Eager code
*after* the last graph (a head run eagerly on its outputs) is out of its sight.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch

from ..passes.context import CPRewriteError

_MAX_NODES = 100_000  # an autograd history longer than this is not walked to the end


def eager_parameters(tensors: Sequence[torch.Tensor]) -> List[str]:
    """``"<op> -> parameter (shape)"`` for every nn.Parameter reached from ``tensors``'
    autograd history without passing a compiled graph."""
    todo = [(t.grad_fn, "input") for t in tensors if t.grad_fn is not None]
    seen, found = set(), []
    while todo and len(seen) < _MAX_NODES:
        fn, via = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        kind = type(fn).__name__
        if kind == "CompiledFunctionBackward":
            continue
        if kind == "AccumulateGrad":
            if isinstance(fn.variable, torch.nn.Parameter):
                found.append(f"{via} -> parameter {tuple(fn.variable.shape)}")
            continue
        todo.extend((nxt, kind) for nxt, _ in fn.next_functions)
    return found


def guard_eager_parameters(compiled: Callable, grad_inputs: List[int], world: int) -> Callable:
    """``compiled`` that, on its first real call with grad mode on, refuses parameters that
    eager code used to compute the inputs at positions ``grad_inputs``."""
    checked = False

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal checked
        tensors = [args[i] for i in grad_inputs if i < len(args) and isinstance(args[i], torch.Tensor)]
        if not checked and torch.is_grad_enabled() and not any(_is_fake(t) for t in tensors):
            checked = True
            found = eager_parameters([t for t in tensors if t.requires_grad])
            if found:
                raise CPRewriteError(
                    f"cp_compile: grad_sync='none', but parameters were used by code that runs eagerly, outside "
                    f"every ring_cp graph, before this one ({'; '.join(found[:4])}). Every CP rank computes their "
                    f"full gradient, so the sum over the cp ranks that DDP/FSDP does would make it {world} times too "
                    "large. This happens when Dynamo runs the model's forward eagerly (per-layer fully_shard, a graph "
                    "break inside a loop) and the forward calls built-in modules (nn.Embedding, nn.Linear). Fix: "
                    "compile those modules too (module = torch.compile(module, backend=...), e.g. for the embedding "
                    "and the head), or use grad_sync='allreduce' with DDP/FSDP over the dp ranks only."
                )
        return compiled(*args, **kwargs)

    return run


def _is_fake(t: torch.Tensor) -> bool:
    """Fake tensors: DDPOptimizer runs each compiled piece on them at compile time."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
