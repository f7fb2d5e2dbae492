"""Recurrent kernels under context parallelism: the registration API and state passing.

A model's recurrent layers (Mamba, Mamba2/SSD, GLA, the gated delta rule, lightning attention, RG-LRU,
RWKV) call kernels that take the state entering the sequence and return the state leaving it.
:func:`register_recurrence` declares that contract for one kernel; ring_cp then runs the kernel on
each rank's own runs of tokens, from the state entering each run, composed in global order from
O(state) summaries of the earlier runs (one all-gather per layer, independent of S): exact, 1/N of
the tokens per rank, never the sequence gathered.

    import cp_compile
    from fla.ops.gla import chunk_gla

    cp_compile.register_recurrence(
        chunk_gla, seq_args={"q": 1, "k": 1, "v": 1, "g": 1}, outputs={0: 1},
        initial_state="initial_state", final_state=1, final_state_flag="output_final_state",
        transition="elementwise", drive=("v",))
    model = torch.compile(model, backend="ring_cp")   # the model calls chunk_gla unchanged

Registration keeps the kernel as one node of the graph: a Python function becomes an opaque op run
for real, never traced (:mod:`.opaque`; its shapes from ``fake=``), a ``torch.ops`` overload is one
already. docs/api.md lists the fields and how to choose ``transition``; :mod:`.spec` defines them;
:mod:`.state_passing` is the math.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from .opaque import _GRAPH_FNS, graph_function
from .spec import SPECS, TRANSITIONS, RecurrenceSpec, Transition, recurrence_spec

log = logging.getLogger(__name__)


def register_recurrence(target: Callable, *, seq_args: Mapping[str, int], outputs: Mapping[int, int],
                        initial_state: str, final_state: int, final_state_flag: Optional[str] = None,
                        transition: Transition = "elementwise", drive: Tuple[str, ...] = (),
                        pad_values: Optional[Mapping[str, float]] = None, when: Optional[Mapping[str, Any]] = None,
                        fake: Optional[Callable] = None) -> RecurrenceSpec:
    """Declare ``target``'s state-passing contract (fields: :class:`RecurrenceSpec`); return the spec.

    A Python function is kept whole in the compiled graphs as one opaque op, run for real and never
    traced (:mod:`.opaque`): ``fake``, a function of the same arguments returning tensors of the
    result's shapes and dtypes, gives its shapes (default: ``target`` itself, which serves a kernel
    written in torch ops; a Triton or CUDA kernel needs one). A ``torch.ops`` overload is used as is.
    Registering the same target again replaces its contract. Call it before ``torch.compile`` traces
    the model (Dynamo decides at trace time how to treat the kernel)."""
    if fake is not None and not callable(fake):
        raise TypeError(f"cp_compile.register_recurrence: fake= must be a function of the kernel's arguments, "
                        f"got {type(fake).__name__}")
    opaque = not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    spec = RecurrenceSpec(target=target, seq_args=dict(seq_args), outputs=dict(outputs), initial_state=initial_state,
                          final_state=final_state, final_state_flag=final_state_flag, transition=transition,
                          drive=tuple(drive), pad_values=dict(pad_values or {}),
                          when=dict(when or {}))  # checked against the kernel's own signature
    if opaque:
        spec = dataclasses.replace(spec, target=graph_function(target, fake))
    SPECS[spec.target] = spec
    log.info("cp_compile: %s registered as a recurrence (%s transition)", spec.name, transition)
    return spec


def unregister_recurrence(target: Any) -> None:
    """Forget ``target``'s contract: ring_cp then treats its calls as any other op's. A Python kernel
    stays one opaque op of the graphs (Dynamo's substitution cannot be undone; numbers unchanged)."""
    SPECS.pop(_GRAPH_FNS.get(target, target), None)


__all__ = ["RecurrenceSpec", "TRANSITIONS", "register_recurrence", "recurrence_spec", "unregister_recurrence"]
