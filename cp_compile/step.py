"""``@cp_compile.context_parallel``: make a whole training step context-parallel.

Before::

    def train_step(model, optimizer, input_ids, labels):
        loss = model(input_ids, labels=labels)
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        return loss

After ``@context_parallel(mesh=cp_mesh, shard={"input_ids": 1, "labels": 1})`` every
rank calls the step with the full batch (or, with ``inputs="local"``, with its own
``cp_compile.shard`` of the named arguments) and gets the global loss back. The
step is compiled with the ``ring_cp`` backend: the forward and the loss become the
context-parallel graph (this rank's tokens, ring attention, exact global loss), its
backward all-reduces the parameter gradients over the CP group, and
``loss.backward()`` / the optimizer step run on the results like on one device.
Dynamo splits the step at ``loss.backward()``; the piece without attention (the
optimizer step) goes to the inner compiler unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional

import torch

from .backend.compiler import RingCP
from .sequence import unshard


def context_parallel(
    fn: Optional[Callable] = None,
    *,
    mesh: Any = None,
    shard: Optional[Dict[str, int]] = None,
    load_balance: str = "zigzag",
    inputs: str = "full",
    **options: Any,
) -> Callable:
    """Decorate a training step (function or method) to run context-parallel.

    Args:
        mesh: the CP group (None = WORLD, a ProcessGroup, or a DeviceMesh with a "cp" dim).
        shard: ``{argument name: sequence dim}`` of the step's arguments that carry the
            sequence (e.g. ``{"input_ids": 1, "labels": 1}``); None = detect automatically.
        load_balance: "zigzag" | "striped" | "contiguous" | "documents" (a layout computed per
            batch from the document ids the attention masks compare; needs inputs="full").
        inputs: "full" (every rank passes the whole batch) or "local" (the data loader
            already called ``cp_compile.shard`` on the named arguments; they are gathered
            before the step, which is cheap for token ids and labels).
        **options: any other ``RingCP`` option (``inner``, ``rotate``, ``outputs``, ``timeout``, ``check_batch``, ...).
    """
    if inputs not in ("full", "local"):
        raise ValueError(f"cp_compile: unknown inputs {inputs!r}. Fix: use 'full' or 'local'.")
    if inputs == "local" and not shard:
        raise ValueError("cp_compile: inputs='local' needs shard={argument name: dim} to know what to gather.")

    def decorate(step: Callable) -> Callable:
        backend = RingCP(mesh=mesh, load_balance=load_balance, seq_inputs=dict(shard) if shard else "auto", **options)
        compiled = torch.compile(step, backend=backend)
        signature = inspect.signature(step)
        missing = set(shard or {}) - set(signature.parameters)
        if missing:
            raise ValueError(
                f"cp_compile: shard names {sorted(missing)} are not parameters of {step.__name__}"
                f"{signature}. Fix: use the step's argument names."
            )

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            if inputs == "local":
                bound = signature.bind(*args, **kwargs)
                for name, dim in shard.items():
                    bound.arguments[name] = unshard(bound.arguments[name], dim, group=mesh, load_balance=load_balance)
                args, kwargs = bound.args, bound.kwargs
            return compiled(*args, **kwargs)

        run.backend = backend  # for inspection: rewritten graphs, fallbacks
        return run

    return decorate(fn) if fn is not None else decorate
