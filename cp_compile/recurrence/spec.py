"""What a recurrent kernel declares so that ring_cp can run it on each rank's share of the sequence.

A kernel of the field (flash-linear-attention's ``chunk_gla`` / ``chunk_gated_delta_rule``, mamba_ssm's
``mamba_chunk_scan_combined``, a user's own) computes a linear recurrence along the sequence,
``h_t = A_t h_{t-1} + b_t``, ``y_t = f(h_t, x_t)``, and takes the state entering the sequence
(``initial_state``) and returns the state leaving it (``output_final_state``). That contract is all
state passing needs: each rank runs the kernel on its own runs of tokens from the state entering each
run, and those states come from O(state) summaries of the earlier runs (:mod:`.state_passing`).

    spec = RecurrenceSpec(target=chunk_gla, seq_args={"q": 1, "k": 1, "v": 1, "g": 1}, outputs={0: 1},
                          initial_state="initial_state", final_state=1, final_state_flag="output_final_state",
                          transition="elementwise", drive=("v",))

``transition`` says how a run's map of the state is found, hence how the ranks combine their runs:

* ``"elementwise"``: ``A_t`` acts on each state entry alone (diagonal or scalar decay: Mamba, Mamba2/SSD,
  GLA, RetNet, lightning attention, RG-LRU, RWKV). A run's map is the state-shaped ``M`` with
  ``h_out = M * h_in + c``: the kernel run with the ``drive`` arguments zeroed from ``h_in = 1``.
* ``"matrix"``: the state is (..., K, V) and ``A_t`` is a (K, K) matrix acting on dim -2, independent of
  the ``drive`` arguments, whose last dim is V (the delta rule: ``A_t = g_t (I - beta_t k_t k_tᵀ)``).
  A run's map is (..., K, K): the kernel run with the drive zeroed and K wide, from ``h_in = I``.
* ``"serial"``: nothing is known of ``A_t``: the state is passed run to run in global order (exact,
  memory 1/N, but one run at a time), warned.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Literal, Mapping, Optional, Tuple

Transition = Literal["elementwise", "matrix", "serial"]
TRANSITIONS: Tuple[str, ...] = ("elementwise", "matrix", "serial")


@dataclass(frozen=True)
class RecurrenceSpec:
    """The state-passing contract of one recurrent kernel (see the module docstring).

    Attributes:
        target: the function or ``torch.ops`` overload the model calls.
        seq_args: per-token tensor arguments, parameter name -> sequence dim.
        outputs: per-token outputs, index in the returned tuple (0 for a lone tensor) -> sequence dim.
        initial_state: the parameter taking the state entering the sequence (None or a tensor).
        final_state: the index of the returned state leaving the sequence.
        final_state_flag: a bool parameter that asks for the final state (set True on every run), or None
            when the kernel always returns it.
        transition: ``"elementwise"``, ``"matrix"`` or ``"serial"``.
        drive: the arguments that, all zeroed, leave the homogeneous recurrence ``h_t = A_t h_{t-1}``
            (``"elementwise"`` and ``"matrix"`` need at least one; none may be used by ``A_t``).
        pad_values: per sequence argument, the value of a padding token that makes its step the
            identity (``A_t = I``, ``b_t = 0``); 0.0 for any argument not named (log-space gates, dt, k, v).
        homogeneous: instead of ``drive``, a bool parameter that, True, makes the kernel run the
            homogeneous recurrence ``h_t = A_t h_{t-1}`` itself (a folded loop's kernel: :mod:`.loops`).
        when: arguments the contract holds for only with these values (``{"reverse": False,
            "cu_seqlens": None}``); a call with any other value is run on the gathered sequence, warned.
        chunk: tokens per step of a kernel that steps through its sequence in chunks it cannot cut (a
            folded chunk loop: lightning attention's blocks); each run must hold a multiple of it, so
            the runs keep the single-device chunk grid. 1: any run length.
    """

    target: Callable
    seq_args: Mapping[str, int]
    outputs: Mapping[int, int]
    initial_state: str
    final_state: int
    final_state_flag: Optional[str] = None
    transition: Transition = "elementwise"
    drive: Tuple[str, ...] = ()
    homogeneous: Optional[str] = None
    pad_values: Mapping[str, float] = field(default_factory=dict)
    when: Mapping[str, Any] = field(default_factory=dict)
    chunk: int = 1

    def __post_init__(self) -> None:
        _check(self)

    @property
    def name(self) -> str:
        """How the WARNINGs and explain name the kernel."""
        return getattr(self.target, "__qualname__", None) or str(self.target)

    def parameters(self) -> Tuple[str, ...]:
        """The target's parameter names in order (its schema's for an op overload)."""
        schema = getattr(self.target, "_schema", None)
        if schema is not None:
            return tuple(a.name for a in schema.arguments)
        return tuple(inspect.signature(self.target).parameters)

    def pad_value(self, arg: str) -> float:
        return float(self.pad_values.get(arg, 0.0))


def _check(spec: RecurrenceSpec) -> None:
    """Refuse a contract that cannot be honoured, naming the field and the fix."""
    where = f"cp_compile.register_recurrence({spec.name})"
    if spec.transition not in TRANSITIONS:
        raise ValueError(f"{where}: transition={spec.transition!r}; choose one of {TRANSITIONS}.")
    try:
        params = set(spec.parameters())
    except (TypeError, ValueError):
        params = None  # a builtin without a signature: the names are checked at the first call
    named = {"seq_args": tuple(spec.seq_args), "initial_state": (spec.initial_state,), "drive": spec.drive,
             "pad_values": tuple(spec.pad_values), "when": tuple(spec.when),
             "final_state_flag": (spec.final_state_flag,) if spec.final_state_flag else (),
             "homogeneous": (spec.homogeneous,) if spec.homogeneous else ()}
    for what, names in named.items():
        missing = [n for n in names if params is not None and n not in params]
        if missing:
            raise ValueError(f"{where}: {what} names {missing}, which are not parameters of the kernel "
                             f"({sorted(params)}). Fix: use the kernel's own parameter names.")
    if not spec.seq_args or not spec.outputs:
        raise ValueError(f"{where}: seq_args and outputs must each name at least one per-token tensor.")
    if spec.transition != "serial" and not spec.drive and not spec.homogeneous:
        raise ValueError(f"{where}: transition={spec.transition!r} needs drive=(...): the arguments that, zeroed, "
                         "leave only the decay of the state (e.g. ('v',) for linear attention, ('x',) for an SSM). "
                         "Fix: name them, or transition='serial'.")
    bad = [d for d in spec.drive if d not in spec.seq_args]
    if bad:
        raise ValueError(f"{where}: drive names {bad}, which are not in seq_args. Fix: drive arguments are per-token.")
    if not isinstance(spec.chunk, int) or spec.chunk < 1:
        raise ValueError(f"{where}: chunk={spec.chunk!r}; it is the tokens per step, an int >= 1.")
    if spec.final_state in spec.outputs:
        raise ValueError(f"{where}: output {spec.final_state} is both the final state and a per-token output.")


@dataclass(frozen=True)
class StatePassed:
    """One recurrence as the rewrite ran it (the record and ``cp-compile explain`` list these).

    Attributes:
        node: the graph node's name; kernel: the kernel's name; where: the model source line.
        transition: how its runs were combined; state: the state's global shape; runs: runs per rank.
        bytes: what each rank receives per call: the one all-gather of N·runs summaries (the serial
            form: its N·runs all-reduces of one state).
    """

    node: str
    kernel: str
    where: str
    transition: str
    state: Tuple[int, ...]
    runs: int
    bytes: int

    def describe(self) -> str:
        """One line for explain."""
        how = {"serial": "state passed rank to rank (serial)",
               "scan": "run totals combined in global order, one all-gather"}.get(
            self.transition, f"state passing, {self.transition} maps, one all-gather")
        return (f"{self.kernel} at {self.where}: {how}; state {tuple(self.state)}, {self.runs} run(s) per rank, "
                f"{self.bytes} B received per rank")


SPECS: Dict[Any, RecurrenceSpec] = {}


def recurrence_spec(target: Any) -> Optional[RecurrenceSpec]:
    """The registered contract of ``target`` (a graph node's target, or the kernel registered), or None."""
    from .opaque import _GRAPH_FNS

    own = getattr(target, "recurrence_spec", None)  # a folded loop's kernel carries its own (.loops)
    if isinstance(own, RecurrenceSpec):
        return own
    try:
        return SPECS.get(target) or SPECS.get(_GRAPH_FNS.get(target))
    except TypeError:  # an unhashable target
        return None
