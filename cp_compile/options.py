"""Options of cp_compile, typed so that the type is the documentation and the validation.

:class:`RingOptions` holds the knobs of the ring attention op; :class:`BackendOptions`
those of the ``ring_cp`` backend (``torch.compile(..., backend="ring_cp", options={...})``
or ``RingCP(**options)``); :class:`RewriteOptions` the part of them the graph rewrite reads
(:meth:`BackendOptions.rewrite_options`). Every field with a closed set of values is a ``Literal``: the
accepted values are read from that type (:func:`literal_choices`), so the type, the
validation and the error message cannot disagree. All are frozen dataclasses, so an
options object can be hashed into compile caches (RewriteOptions with a seq_inputs dict aside).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Tuple, Union

LoadBalance = Literal["zigzag", "striped", "contiguous", "documents"]
Rotate = Literal["p2p", "allgather"]
Kernel = Union[Literal["auto", "aten", "triton", "reference"], str]  # or a registered kernel's name
Mode = Literal["full", "local"]
GradSync = Literal["allreduce", "none"]
Inner = Literal["inductor", "aot_eager", "eager"]
Strategy = Literal["ring", "ulysses", "2d", "auto"]


def literal_choices(tp: Any) -> Tuple[str, ...]:
    """The values of a ``Literal[...]`` type (``()`` for any other type)."""
    return tuple(typing.get_args(tp)) if typing.get_origin(tp) is Literal else ()


LOAD_BALANCES: Tuple[str, ...] = literal_choices(LoadBalance)
ROTATES: Tuple[str, ...] = literal_choices(Rotate)
INNER: Tuple[str, ...] = literal_choices(Inner)
STRATEGIES: Tuple[str, ...] = literal_choices(Strategy)
KERNELS: Tuple[str, ...] = literal_choices(typing.get_args(Kernel)[0])  # the built-in ones


def check_choice(what: str, value: object, choices: Tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``; raise a ValueError naming them otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"cp_compile: unknown {what} {value!r}. Fix: use one of {', '.join(map(repr, choices))}."
        )
    return value


def check_timeout(value: object) -> Optional[float]:
    """Return ``value`` as seconds (> 0) or None; raise a ValueError naming the fix otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"cp_compile: timeout must be a positive number of seconds or None, got {value!r}. "
            "Fix: e.g. timeout=300, or None for the process group's own timeout."
        )
    return float(value)


def check_strategy(strategy: str, degree: Any, hardware: Any) -> None:
    """``ulysses_degree`` and ``hardware`` against ``strategy``, with errors naming the fix (that the
    degree divides the CP group is checked when the group is known: ``cp_compile.ulysses.groups``)."""
    if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
        raise ValueError(f"cp_compile: ulysses_degree must be a positive int or None, got {degree!r}. "
                         "Fix: e.g. ulysses_degree=8 (the GPUs of one node).")
    if degree is not None and strategy == "ring":
        raise ValueError(f"cp_compile: ulysses_degree={degree} with strategy='ring' (the ring has no Ulysses "
                         "degree). Fix: strategy='2d' or 'auto' to use it, or drop ulysses_degree.")
    if hardware is not None and strategy != "auto":
        raise ValueError(f"cp_compile: hardware={hardware!r} prices strategy='auto' only, strategy is "
                         f"{strategy!r}. Fix: strategy='auto', or drop hardware.")
    if hardware is not None:
        from .hardware import parse_hardware

        try:
            parse_hardware(hardware)
        except ValueError as e:
            raise ValueError(f"cp_compile: {e}. Fix: hardware= one of those (strategy='auto' prices on it).") from None


def check_literals(options: Any) -> None:
    """Check every ``Literal``-typed field of the dataclass ``options`` against its type.

    The choices are read from the types once, at import (:data:`_LITERAL_FIELDS`): the check
    also runs inside ``torch.compile``d code (``ring_attention`` builds a RingOptions), where
    Dynamo cannot trace ``typing.get_type_hints``."""
    for name, choices in _LITERAL_FIELDS[type(options)]:
        check_choice(name, getattr(options, name), choices)


def _literal_fields(cls: type) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, literal_choices(hints[f.name])) for f in dataclasses.fields(cls)
                 if literal_choices(hints[f.name]))


@dataclass(frozen=True)
class RingOptions:
    """How the ring attention op runs."""

    load_balance: LoadBalance = "zigzag"
    """Token-to-rank layout: ``"zigzag"`` (rank r holds chunks r and 2N-1-r: balanced causal
    work), ``"striped"`` (token i on rank i mod N) or ``"contiguous"`` (one chunk per rank).
    ``"documents"``: a per-batch table of positions balancing causal work over packed documents
    (:func:`cp_compile.document_layout.layout_table`); the ring op then needs ``positions=table``."""
    rotate: Rotate = "p2p"
    """``"p2p"``: K/V pass around the ring with double-buffered async send/recv, overlapped
    with compute; ``"allgather"``: all K/V gathered once (N x the K/V memory, fewer transfers)."""
    kernel: Kernel = "auto"
    """Local block kernel: ``"auto"`` (``"triton"`` on CUDA when Triton is installed, else
    ``"aten"``), ``"aten"``, ``"triton"``, ``"reference"`` (fp32 plain PyTorch, for tests) or
    any name registered with :func:`cp_compile.kernels.register_kernel` (checked when used)."""
    timeout: Optional[float] = None
    """Seconds every wait of the ring may take before it raises
    :class:`cp_compile.ring.faults.RingCommError` naming the peer, the step and the direction;
    ``None``: the process group's own timeout (``init_process_group(timeout=...)``)."""

    def __post_init__(self) -> None:
        check_literals(self)
        check_timeout(self.timeout)
        if not isinstance(self.kernel, str):
            raise ValueError(f"cp_compile: kernel must be a name (str), got {self.kernel!r}.")


SeqInputs = Union[Literal["auto"], Dict[str, int]]


@dataclass(frozen=True)
class RewriteOptions:
    """What the graph rewrite is asked for (:attr:`cp_compile.passes.context.RewriteContext.options`):
    the fields of :class:`BackendOptions` the passes read, frozen, apart from what they find."""

    load_balance: LoadBalance = "zigzag"
    rotate: Rotate = "p2p"
    kernel: Kernel = "auto"
    seq_inputs: SeqInputs = "auto"  # a dict is the rewrite's own copy (BackendOptions.rewrite_options)
    inputs: Mode = "full"  # "local": sequence inputs arrive already sharded (cp_compile.shard)
    outputs: Mode = "full"
    grad_sync: GradSync = "allreduce"
    strict: bool = False
    timeout: Optional[float] = None  # given to every ring op (the finalize pass ring_timeout)
    strategy: Strategy = "ring"  # per attention: ring, Ulysses, 2-D, or chosen by cost (passes/finalize/strategy)
    ulysses_degree: Optional[int] = None
    hardware: Optional[str] = None  # the profile strategy="auto" prices on (cp_compile.hardware)

    def __post_init__(self) -> None:
        check_literals(self)
        check_timeout(self.timeout)
        check_strategy(self.strategy, self.ulysses_degree, self.hardware)
        if not isinstance(self.kernel, str):
            raise ValueError(f"cp_compile: kernel must be a name (str), got {self.kernel!r}.")
        if self.seq_inputs != "auto" and not isinstance(self.seq_inputs, dict):
            raise ValueError("cp_compile: seq_inputs must be 'auto' or a dict {argument name: sequence dim}.")


@dataclass(frozen=True)
class BackendOptions:
    """Options of the ``ring_cp`` backend (``docs/backend.md`` shows each one at work)."""

    mesh: Any = None
    """The CP group: ``None`` (the default process group), a ``ProcessGroup``, a 1-D
    ``DeviceMesh``, or a DeviceMesh with a ``"cp"`` dim (DP x CP meshes)."""
    load_balance: LoadBalance = "zigzag"
    """How the sequence is laid out over the ranks (see :class:`RingOptions`). ``"documents"``: the
    layout is computed each call from the document ids the attention masks compare
    (``torch.ops.cp_compile.document_table``); needs every attention to have a document mask."""
    rotate: Rotate = "p2p"
    """How K/V travel (see :class:`RingOptions`)."""
    kernel: Kernel = "auto"
    """The block kernel of every ring op (see :class:`RingOptions`)."""
    seq_inputs: SeqInputs = "auto"
    """Which graph inputs carry the sequence: ``"auto"`` (found from attention's length) or
    ``{argument name: sequence dim}``."""
    inputs: Mode = "full"
    """``"full"``: every rank is given the whole sequence and the graph shards it;
    ``"local"``: each rank is given its own shard (``cp_compile.shard``); needs dynamic=True."""
    outputs: Mode = "full"
    """``"full"``: sequence-long outputs are gathered; ``"local"``: each rank returns its shard."""
    grad_sync: GradSync = "allreduce"
    """``"allreduce"``: parameter gradients are summed over the CP group in the backward graph;
    ``"none"``: left to DDP/FSDP over a group that includes the CP ranks."""
    strict: bool = False
    """Raise instead of warning where the rewrite would gather the full sequence or give no CP."""
    inner: Inner = "inductor"
    """The compiler the rewritten graph is handed to."""
    timeout: Optional[float] = None
    """Seconds a ring wait may take before it raises naming the peer (see :class:`RingOptions`)."""
    strategy: Strategy = "ring"
    """How each attention is split over the CP group: ``"ring"`` (K/V blocks travel around the ring,
    overlapped with compute), ``"ulysses"`` (an all-to-all from sequence- to head-sharded q, k, v, attention
    over the whole sequence for H/N heads, an all-to-all back), ``"2d"`` (Ulysses over ``ulysses_degree``
    consecutive ranks x the ring over the rest: USP / LoongTrain's hybrid) or ``"auto"`` (per attention,
    the cheapest of those on ``hardware`` by :mod:`cp_compile.ulysses.cost`; the record and ``cp-compile
    explain`` say which each attention got and why). Everything else (layout, losses, masks, gradient
    sync) is the same under every strategy."""
    ulysses_degree: Optional[int] = None
    """The Ulysses degree u of ``"2d"`` and ``"auto"``: a divisor of the CP group's size (the GPUs of a
    node). ``None``: ``"ulysses"`` uses the whole group; ``"2d"`` the largest proper divisor of N;
    ``"auto"`` weighs ring, Ulysses over N and 2-D with that default."""
    hardware: Optional[str] = None
    """The profile ``"auto"`` prices on: a name of :data:`cp_compile.hardware.HARDWARE` or
    ``"custom:TFLOPS,GBPS,HBM_GIB[,NODE_GPUS,INTER_GBPS]"``; ``None``: ``h100-cluster`` on CUDA,
    ``cpu-gloo`` otherwise."""
    check_batch: bool = True
    """Under ``inputs="full"``: each call of a rewritten graph first checks, with one all-gather of
    a few int64 over the CP group, that every rank was passed the same per-token inputs (a
    fingerprint of the bytes of each input with a dim of size S: token ids, labels, masks), and raises
    ``BatchMismatchError`` on every rank if not (a sampler over all ranks instead of the DP ranks).
    ``False``: no check and no collective. Never runs with ``inputs="local"`` (each rank's shard
    differs) or a CP group of size 1."""

    def __post_init__(self) -> None:
        check_literals(self)
        check_timeout(self.timeout)
        check_strategy(self.strategy, self.ulysses_degree, self.hardware)
        if not isinstance(self.check_batch, bool):
            raise ValueError(f"cp_compile: check_batch must be True or False, got {self.check_batch!r}.")
        if self.load_balance == "documents" and self.inputs == "local":
            raise ValueError(
                "cp_compile: load_balance='documents' computes each batch's layout from its document ids, but "
                "inputs='local' shards were cut with a fixed layout. Fix: inputs='full' (every rank passes the "
                "whole batch), or load_balance='zigzag'.")
        if self.seq_inputs != "auto" and not isinstance(self.seq_inputs, dict):
            raise ValueError("cp_compile: seq_inputs must be 'auto' or a dict {argument name: sequence dim}.")

    def rewrite_options(self) -> RewriteOptions:
        """The :class:`RewriteOptions` of these options (the mesh becomes the group; inner and
        check_batch belong to the hand-off).

        Read field by field, never with ``dataclasses.asdict``: that deep-copies every value,
        and a ``ProcessGroup`` in ``mesh`` cannot be copied (``TypeError: cannot pickle
        'ProcessGroup'``). ``seq_inputs`` is copied, so the rewrite cannot change the user's dict.
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(RewriteOptions)}
        if isinstance(values["seq_inputs"], dict):
            values["seq_inputs"] = dict(values["seq_inputs"])
        return RewriteOptions(**values)


_LITERAL_FIELDS: Dict[type, Tuple[Tuple[str, Tuple[str, ...]], ...]] = {
    cls: _literal_fields(cls) for cls in (RingOptions, RewriteOptions, BackendOptions)
}
