"""Layout rule for registered recurrent kernels: state passing, never a gather (docs/design.md §17).

    o, h = kernel(q, k, v, g, initial_state=h0, output_final_state=True)     # (B, S, H, D) in, o (B, S, H, D)
    on each rank, its k runs of L tokens (zig-zag: k = 2, contiguous: k = 1), padding set to the identity step:
        c_j = kernel(run_j, initial_state=0).final                            # (B, H, K, V), the run from a zero state
        M_j = kernel(run_j, drive = 0, initial_state=1 | I).final    # elementwise (B, H, K, V) | matrix (B, H, K, K)
        h_in_0..k-1, h = incoming_states(M, c, h0, ...)                       # one all-gather of N·k summaries
        o_j = kernel(run_j, initial_state=h_in_j).out                         # (B, L, H, D)
    -> o = cat(o_j) Sharded(1), h Global

``transition="serial"`` (nothing known of the state's map): run by run in global order, the owner
running its run from the state so far and one ``all_reduce_sum`` handing it on (non-owners add
zeros tied to ``h`` and to their own run's arguments, so every rank's backward reaches every relay
all-reduce): exact, 1/N memory, but the runs one after another, warned.

Either way the final state is tied into the rank's output (``keep_alive``): it reads every rank's
summaries, so the collectives that made them and their backward run on every rank, whether or not
the model reads the final state or this rank reads the others' summaries (autograd would otherwise
drop a backward collective on some ranks only: a hang).

Gathered instead (warned, exact): a layout with no fixed runs (``striped`` on several ranks,
``documents``), a symbolic sequence length, a per-token argument sharded along a dim other than the
one declared, a sharded ``initial_state``, an output the contract does not declare.
"""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ....recurrence import recurrence_spec
from ....recurrence.loops import is_loop_kernel
from ....recurrence.spec import RecurrenceSpec, StatePassed
from ....recurrence.state_passing import incoming_states, keep_alive, summary_bytes
from ....graph_ops import all_reduce_sum
from ...context import global_shape, log, source_line
from ...fx_utils import fake_value
from ...op_vocab import arguments
from ..emitter import Emitter
from ..placements import GLOBAL, Sharded, in_tokens
from .common import _ndim, _no_runs, _norm


def recurrence(em: Emitter, node: fx.Node):
    """A registered recurrent kernel on this rank's runs (see the module docstring)."""
    spec = recurrence_spec(node.target)
    a = arguments(node, spec.parameters())
    why = _refusal(em, node, spec, a)
    if why is not None:
        return em.fallback(node, f"recurrent kernel {spec.name}: {why}")
    state, dtype = _state_meta(spec, node, a)
    table, length = em.index.chunks()
    units = _units(em, spec, a)  # tokens per entry of each argument's sequence dim (> 1: chunks of tokens)
    runs = [_run_args(em, spec, a, j, length, units) for j in range(table.shape[1])]
    order = sorted(((int(table[r, j]), r, j) for r in range(table.shape[0]) for j in range(table.shape[1])))
    order = [(r, j) for _, r, j in order]
    h0 = _initial_state(em, spec, a, runs[0], state, dtype)
    if spec.transition == "serial":
        outs, final = _serial(em, spec, runs, h0, order)
    else:
        outs, final = _parallel(em, spec, runs, h0, order, state)
    # the final state reads every rank's summaries (or relay steps): tied into this rank's output, their
    # collectives and those collectives' backward run on every rank, read or not (no rank skips one)
    outs[-1] = em.call(_tied, outs[-1], min(spec.outputs), final)
    _record(em, node, spec, state, dtype, table.shape[1])
    return _result(em, node, spec, outs, final, _unit(em, spec, a))


def _chunks(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any]) -> set:
    """The chunks (tokens per entry, placements.py) of the kernel's sharded per-token arguments."""
    return {lay.chunk for name in spec.seq_args if isinstance(lay := em.layout(a.get(name)), Sharded)}


def _unit(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any]) -> int:
    """Tokens per entry along the kernel's sequence dims: its sharded arguments' chunk."""
    chunks = _chunks(em, spec, a)
    return chunks.pop() if len(chunks) == 1 else 1


def _units(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any]) -> Dict[str, int]:
    """Tokens per entry along each per-token argument's sequence dim. A registered kernel reads them all
    alike (:func:`_unit`); a folded loop's step may read one position of the keys and one entry of a
    chunk total (xLSTM), so each argument holds the sequence by its own unit."""
    if not is_loop_kernel(spec.target):
        unit = _unit(em, spec, a)
        return {name: unit for name in spec.seq_args}
    return {name: em.ctx.seq_len // global_shape(x)[_norm(spec.seq_args[name], _ndim(x))]
            for name in spec.seq_args if isinstance(x := a.get(name), fx.Node)}


def _refusal(em: Emitter, node: fx.Node, spec: RecurrenceSpec, a: Dict[str, Any]) -> Optional[str]:
    """Why the kernel cannot be state-passed here, or None."""
    why = _outside_contract(spec, a) or _no_runs(em) or _mixed_units(em, spec, a) or _misplaced_argument(em, spec, a)
    if why is not None:
        return why
    if (spec.transition == "serial" or is_loop_kernel(spec.target)) and _padded(em) and _reads_final_state(node, spec):
        return (f"the sequence's {em.ctx.seq_len} tokens are padded to {_padded(em)}, and this kernel (serial, "
                "or a folded loop) has no identity step to pad with, so its final state would be wrong (fix: a length "
                f"that is a multiple of {em.ctx.world * em.index.chunks()[0].shape[1]}, or declare transition= "
                "and pad_values=)")
    table, run = em.index.chunks()
    if (run if is_loop_kernel(spec.target) else run // _unit(em, spec, a)) % spec.chunk:  # (a loop's: tokens)
        return (f"its steps read chunks of {spec.chunk} tokens and each rank's runs hold {run}, not a multiple, so "
                f"the runs would cut the model's chunks (fix: a sequence length that is a multiple of "
                f"{table.numel() * spec.chunk}, or a smaller chunk size)")
    split = [name for name, v in a.items() if name not in spec.seq_args and isinstance(em.layout(v), Sharded)]
    if split:
        return (f"its {split[0]!r} is split by sequence but is not a per-token argument of the contract "
                "(fix: declare it in seq_args=, or pass the whole tensor)")
    result = fake_value(node)
    extra = [i for i, v in enumerate(result) if v is not None and i not in spec.outputs and i != spec.final_state] \
        if isinstance(result, (tuple, list)) else []
    if extra:
        return f"it returns outputs {extra} that the contract does not declare (outputs=, final_state=)"
    return None


def _misplaced_argument(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any]) -> Optional[str]:
    """Why a per-token argument does not run along the sequence as declared, or None."""
    for name, dim in spec.seq_args.items():
        x = a.get(name)
        if not isinstance(x, fx.Node):
            continue
        shape = global_shape(x)
        d = _norm(dim, len(shape))
        entries = spec.target.entries(name, em.ctx.seq_len) if is_loop_kernel(spec.target) else \
            em.ctx.seq_len // _unit(em, spec, a)
        if shape[d] != entries:
            return f"argument {name!r} has {shape[d]} along its sequence dim {dim}, not the sequence's {entries}"
        lay = em.layout(x)
        if isinstance(lay, Sharded) and (lay.dim != d or lay.inner != 1 or lay.window is not None):
            return (f"argument {name!r} is split along dim {lay.dim} (inner {lay.inner}), the kernel's sequence dim "
                    f"is {d} (fix: declare seq_args={{{name!r}: {lay.dim}}} if that is its sequence dim)")
    return None


def _mixed_units(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any]) -> Optional[str]:
    """Why the per-token arguments hold the sequence in different units (tokens, chunks of C), or None."""
    chunks = _chunks(em, spec, a)
    if len(chunks) > 1 and not is_loop_kernel(spec.target):  # (a loop's reads: _misplaced_argument)
        return f"its per-token arguments hold the sequence in different chunks of tokens {sorted(chunks)}"
    return None


def _outside_contract(spec: RecurrenceSpec, a: Dict[str, Any]) -> Optional[str]:
    """Why this call's arguments are outside the values the contract holds for (``when=``), or None."""
    for name, want in spec.when.items():
        given = a.get(name, _default(spec, name))
        if isinstance(given, fx.Node) or given != want:
            shown = "a tensor" if isinstance(given, fx.Node) else repr(given)
            return f"its {name}={shown}, and the contract holds for {name}={want!r} only (when= of its registration)"
    return None


def _default(spec: RecurrenceSpec, name: str) -> Any:
    """The kernel's default for parameter ``name`` (None when it has none or no signature)."""
    try:
        p = inspect.signature(spec.target).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def _padded(em: Emitter) -> int:
    """The padded length when the runs hold more than the sequence's tokens, else 0."""
    table, length = em.index.chunks()
    total = table.numel() * length
    return total if total != em.ctx.seq_len else 0


def _reads_final_state(node: fx.Node, spec: RecurrenceSpec) -> bool:
    """Whether anything reads the kernel's returned final state."""
    return any(u.target is operator.getitem and u.args[1] == spec.final_state and u.users for u in node.users)


def _state_meta(spec: RecurrenceSpec, node: fx.Node, a: Dict[str, Any]) -> Tuple[Tuple[int, ...], torch.dtype]:
    """(shape, dtype) of the state: the initial state's, else the final state the kernel returns, else
    the one a fake run of the kernel (on the global fake arguments, final state asked for) returns."""
    h0 = a.get(spec.initial_state)
    if isinstance(h0, fx.Node):
        v = fake_value(h0)
        return tuple(v.shape), v.dtype
    result = fake_value(node)
    if isinstance(result, (tuple, list)) and isinstance(result[spec.final_state], torch.Tensor):
        v = result[spec.final_state]
        return tuple(v.shape), v.dtype
    with FakeTensorMode():  # one fresh mode: the graph's values may come from several (re-propagated ones)
        fakes = {k: _fresh(fake_value(v)) if isinstance(v, fx.Node) else v for k, v in a.items()}
        if spec.final_state_flag:
            fakes[spec.final_state_flag] = True
        v = spec.target(**fakes)[spec.final_state]
    return tuple(v.shape), v.dtype


def _fresh(v: Any) -> Any:
    """A tensor like ``v`` (shape, strides, dtype) in the current fake mode; anything else as is."""
    if not isinstance(v, torch.Tensor):
        return v
    return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device,
                               requires_grad=v.requires_grad)


def _local(em: Emitter, spec: RecurrenceSpec, name: str, x: fx.Node, unit: int = 1) -> fx.Node:
    """``x``'s local rows (indexed if whole), padding rows set to the argument's identity value. A folded
    loop declares none (its final state is refused when padded): its padding rows copy the rank's first
    row, a real token, so the step's outputs there stay finite (``num / den`` of a zero row is NaN, whose
    backward would poison every gradient although no real token reads the padding)."""
    d = _norm(spec.seq_args[name], _ndim(x))
    local = em.env[x] if isinstance(em.layout(x), Sharded) else em.to_sharded(x, d, chunk=unit)
    mask = em.valid_mask(x, local, d, 1)
    if mask is None:
        return local
    fill = em.method("narrow", local, d, 0, 1) if is_loop_kernel(spec.target) else spec.pad_value(name)
    return em.call(torch.where, mask, local, fill)


def _run_args(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any], j: int, length: int,
              units: Dict[str, int]) -> Dict[str, Any]:
    """The kernel's arguments for this rank's run ``j`` of ``length`` tokens (entries [j·L, (j+1)·L) of
    each shard, L = length / the argument's tokens per entry), by name."""
    kw = dict(em.value(a))
    for name in spec.seq_args:
        x = a.get(name)
        if isinstance(x, fx.Node):
            d, entries = _norm(spec.seq_args[name], _ndim(x)), length // units[name]
            kw[name] = em.method("narrow", _local(em, spec, name, x, units[name]), d, j * entries, entries)
    if spec.final_state_flag:
        kw[spec.final_state_flag] = True
    return kw


def _initial_state(em: Emitter, spec: RecurrenceSpec, a: Dict[str, Any], run: Dict[str, Any],
                   state: Tuple[int, ...], dtype: torch.dtype) -> fx.Node:
    """The state entering the sequence: the model's (every rank holds it), else zeros."""
    h0 = a.get(spec.initial_state)
    if isinstance(h0, fx.Node):
        return em.env[h0]
    return em.method("new_zeros", _any_tensor(spec, run), state, dtype=dtype)


def _any_tensor(spec: RecurrenceSpec, run: Dict[str, Any]) -> fx.Node:
    return next(run[n] for n in spec.seq_args if isinstance(run.get(n), fx.Node))


def _call(em: Emitter, spec: RecurrenceSpec, run: Dict[str, Any], h: fx.Node) -> fx.Node:
    return em.call(spec.target, **{**run, spec.initial_state: h})


def _probe(em: Emitter, spec: RecurrenceSpec, run: Dict[str, Any], state: Tuple[int, ...]) -> fx.Node:
    """The run's map of the state: the kernel from 1 (elementwise) or I (matrix) with the drive zeroed."""
    x = _any_tensor(spec, run)
    probe = dict(run)
    if spec.transition == "matrix":  # (..., K, V) state, A on dim -2: from the identity (..., K, K)
        h = em.call(torch.diag_embed, em.method("new_ones", x, state[:-1]))
    else:
        h = em.method("new_ones", x, state)
    if spec.homogeneous:  # the kernel drops its own drive (a folded loop: recurrence/loops.py)
        probe[spec.homogeneous] = True
    for name in () if spec.homogeneous else spec.drive:  # the drive zeroed (K wide for a matrix)
        probe[name] = em.call(torch.zeros_like, run[name]) if spec.transition == "elementwise" else \
            em.call(_resized_zeros, run[name], state[-2])
    return em.call(operator.getitem, _call(em, spec, probe, h), spec.final_state)


def _resized_zeros(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros like ``x`` with its last dim ``width`` wide (the matrix probe's drive)."""
    return x.new_zeros((*x.shape[:-1], width))


def _parallel(em: Emitter, spec: RecurrenceSpec, runs: List[Dict[str, Any]], h0: fx.Node,
              order: List[Tuple[int, int]], state: Tuple[int, ...]) -> Tuple[List[fx.Node], fx.Node]:
    """Every run from a zero state and its probe, one exchange of the summaries, every run again from
    its incoming state: (the runs' results, the final state)."""
    zero = em.method("new_zeros", h0, state)  # h0's dtype and device
    finals = [em.call(operator.getitem, _call(em, spec, run, zero), spec.final_state) for run in runs]
    maps = [_probe(em, spec, run, state) for run in runs]
    composed = em.call(incoming_states, em.call(torch.stack, maps), em.call(torch.stack, finals), h0,
                       em.ctx.world, em.ctx.group.name, order, em.ctx.group.rank, spec.transition)
    outs = [_call(em, spec, run, em.call(operator.getitem, composed, j)) for j, run in enumerate(runs)]
    return outs, em.call(operator.getitem, composed, len(runs))


def _serial(em: Emitter, spec: RecurrenceSpec, runs: List[Dict[str, Any]], h0: fx.Node,
            order: List[Tuple[int, int]]) -> Tuple[List[fx.Node], fx.Node]:
    """Run by run in global order: the owner runs it, one all_reduce_sum hands the state on."""
    rank, h = em.ctx.group.rank, h0
    outs: List[Any] = [None] * len(runs)
    for r, j in order:
        if r == rank:
            outs[j] = _call(em, spec, runs[j], h)
            handed = em.call(operator.getitem, outs[j], spec.final_state)
        else:
            handed = em.call(_tied_zeros, h, *_tensors(runs[0]))
        h = em.call(all_reduce_sum, handed, em.ctx.group.name)
    return outs, h


def _tensors(run: Dict[str, Any]) -> List[fx.Node]:
    return [v for v in run.values() if isinstance(v, fx.Node)]


def _tied_zeros(h: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """Zeros like ``h`` that depend on ``h`` and on ``inputs`` (a run's arguments on this rank): they
    require grad exactly when the owner's kernel output does, so autograd keeps the backward of the
    relay's all-reduce on every rank or on none (never a rank-dependent count of collectives)."""
    zero = h * 0
    for x in inputs:
        if x.is_floating_point():
            zero = zero + x.reshape(-1)[:1].sum().to(h.dtype) * 0
    return zero


def _tied(result: Any, index: int, anchor: torch.Tensor) -> Any:
    """The kernel's ``result`` with output ``index`` computed after ``anchor`` (keep_alive)."""
    if isinstance(result, torch.Tensor):
        return keep_alive(result, anchor)
    return (*result[:index], keep_alive(result[index], anchor), *result[index + 1:])


def _result(em: Emitter, node: fx.Node, spec: RecurrenceSpec, outs: List[fx.Node], final: fx.Node, unit: int = 1):
    """The node's value as a tuple of new values (the walk indexes it), with their layouts."""
    result = fake_value(node)
    if not isinstance(result, (tuple, list)):
        d = _norm(spec.outputs[0], result.dim())
        pieces = [em.call(operator.getitem, o, 0) for o in outs]
        return em.call(torch.cat, pieces, d), _out_layout(em, spec, result, d, unit)
    values: List[Any] = []
    layouts: List[Any] = []
    for i, v in enumerate(result):
        if i in spec.outputs and isinstance(v, torch.Tensor):
            d = _norm(spec.outputs[i], v.dim())
            values.append(em.call(torch.cat, [em.call(operator.getitem, o, i) for o in outs], d))
            layouts.append(_out_layout(em, spec, v, d, unit))
        elif i == spec.final_state and isinstance(v, torch.Tensor):
            values.append(final)
            layouts.append(GLOBAL)
        else:
            values.append(None)
            layouts.append(None)
    return tuple(values), tuple(layouts)


def _out_layout(em: Emitter, spec: RecurrenceSpec, v: torch.Tensor, d: int, unit: int) -> Sharded:
    """An output's layout along its sequence dim ``d`` (``v``: its global value). A registered kernel's
    entries are its arguments' (``unit`` tokens each). A folded loop's steps each add r rows there for
    its C tokens per step: ``Sharded(d, inner=r, chunk=C)`` in canonical form (r = 1 with C = 1: tokens;
    r = 1: chunks of C; r = C: tokens again; xLSTM's per-chunk states, K rows a chunk: inner K)."""
    rows, seq, per_step = v.shape[d], em.ctx.seq_len, spec.chunk
    if not is_loop_kernel(spec.target) or (rows * per_step) % seq:
        return Sharded(d, chunk=unit)
    return in_tokens(Sharded(d, rows * per_step // seq, chunk=per_step))


def _record(em: Emitter, node: fx.Node, spec: RecurrenceSpec, state: Tuple[int, ...], dtype: torch.dtype,
            runs: int) -> None:
    """What explain and the record say of this recurrence; the serial form is warned."""
    maps = state if spec.transition != "matrix" else (*state[:-2], state[-2], state[-2])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if spec.transition == "serial":  # one all-reduce of the state per run of the sequence
        sent = em.ctx.world * runs * math.prod(state) * itemsize
    else:
        sent = summary_bytes(maps, state, runs, em.ctx.world, itemsize)
    entry = StatePassed(node=node.name, kernel=spec.name, where=source_line(node), transition=spec.transition,
                        state=state, runs=runs, bytes=sent)
    em.ctx.state_passed.append(entry)
    if spec.transition == "serial" and is_loop_kernel(spec.target):
        log.warning("cp_compile: the recurrence loop %s at %s is not elementwise affine in its state (%s): its state "
                    "is passed rank to rank in global order (exact, memory 1/N, but the %d runs one after "
                    "another). A step h' = a * h + b (a, b free of h) runs the runs in parallel (docs/api.md).",
                    spec.name, entry.where, spec.target.serial_reason, em.ctx.world * runs)
    elif spec.transition == "serial":
        log.warning("cp_compile: recurrent kernel %s at %s declares transition='serial': its state is passed rank to "
                    "rank in global order (exact, memory 1/N, but the %d runs one after another). Fix: declare "
                    "transition='elementwise' or 'matrix' with its drive= arguments (docs/api.md).",
                    spec.name, entry.where, em.ctx.world * runs)
    else:
        log.info("cp_compile: %s at %s state-passed (%s, state %s, %d B per rank)", spec.name, entry.where,
                 spec.transition, state, sent)
