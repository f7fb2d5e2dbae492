"""The record of one graph's rewrite: what context parallelism it got, from one code path.

:func:`cp_compile.backend.compiler.rewrite_for_cp` builds a :class:`GraphRecord` for every graph
Dynamo hands over, rewritten or not; the backend keeps them (``RingCP.records``) and
``cp-compile explain`` prints the one of its graph, so the tool and the runtime cannot
disagree about what a model gets. A graph with attention but little of its activation
memory sharded is logged as a WARNING (once per attention line).

``masks`` says, for each ring op of the rewritten graph (in the order of ``attention``), the
form of its mask (its :class:`cp_compile.ring.call_spec.RingCall`'s ``mask_form``) and the bytes
each rank holds for it (the per-rank values of its mask tensors, ``cost.ring_tensors``)::

    causal + documents; per rank: doc_ids (2, 4096) int64 64.0 KiB
    causal + window 16 + explicit; per rank: attn_mask (2, 1, 1, 4096) float32 32.0 KiB
    mask_mod + score_mod; per rank: mask_buffers 16.0 KiB, score_buffers 16 B
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from .cost import TensorHeld, activation_bytes, ring_tensors
from ..passes.context import RewriteContext, source_line
from ..passes.ring_call import ring_call
from ..passes.analyze.graph_inputs import user_name
from ..ulysses.choose import label
from ..warn_once import warn_once

log = logging.getLogger("cp_compile")

LOW_SHARDED = 0.5  # below this sharded fraction of activation bytes, a rewritten graph is reported


@dataclass
class GraphRecord:
    """What the rewrite of one graph did, on this rank. Ranks agree on everything but the byte
    counts, which differ slightly where the sequence is assembled in the graph (each rank takes
    its own rows of the pieces: :mod:`.passes.row_select`)."""

    world_size: int
    attention: List[Tuple[str, str]] = field(default_factory=list)  # (node, source line) of each SDPA found
    rings: int = 0  # ring attention ops in the rewritten graph (== len(attention): a post-condition)
    shard_inputs: Dict[str, int] = field(default_factory=dict)  # forward() argument -> sequence dim
    shard_nodes: Dict[str, int] = field(default_factory=dict)  # where the sequence arises -> dim
    fallbacks: List[str] = field(default_factory=list)  # ops run on the gathered sequence, with their lines
    unsplit: List[str] = field(default_factory=list)  # attention in a form ring_cp cannot split
    whole_inputs: List[str] = field(default_factory=list)  # no attention, yet sequence-long inputs (runtime only)
    act_bytes_local: int = 0  # every intermediate tensor of the rewritten graph, this rank
    act_bytes_global: int = 0  # the same for the original graph on one device
    masks: List[str] = field(default_factory=list)  # per ring op: its mask form and per-rank bytes (mask_forms)
    regions: List[str] = field(default_factory=list)  # checkpointed / nested compile regions opened (passes/regions)
    strategies: List[str] = field(default_factory=list)  # per ring op: its strategy and why (passes/finalize/strategy)
    recurrences: List[str] = field(default_factory=list)  # per recurrent kernel call: how it was state-passed
    recurrent_calls: int = 0  # registered recurrent kernel calls found (those not state-passed were gathered)

    @property
    def sharded_fraction(self) -> float:
        """The fraction f of the activation bytes held sharded, from local = (1 - f)·G + f·G/N
        (1.0: every intermediate holds 1/N of the tokens; 0.0: no context parallelism)."""
        if not (self.rings or self.recurrences) or not self.act_bytes_global or self.world_size < 2:
            return 0.0
        f = (1.0 - self.act_bytes_local / self.act_bytes_global) / (1.0 - 1.0 / self.world_size)
        return min(1.0, max(0.0, f))

    def summary(self) -> str:
        """One line: attention, where sharding starts, fallbacks and the sharded fraction."""
        regions = f"; {len(self.regions)} region(s) opened (checkpointed or nested)" if self.regions else ""
        if not self.attention and not self.recurrent_calls:
            what = "no attention: compiled unchanged, every rank runs it whole"
            if self.unsplit:
                what += f"; {len(self.unsplit)} attention(s) in a form ring_cp cannot split"
            if self.whole_inputs:
                what += f"; takes sequence-long inputs {', '.join(self.whole_inputs)}"
            return what + regions
        starts = [f"input {k} (dim {d})" for k, d in self.shard_inputs.items()]
        starts += [f"{k} (dim {d})" for k, d in self.shard_nodes.items()]
        unsplit = f" ({len(self.unsplit)} more not: gathered)" if self.unsplit else ""
        kinds = [k.split(":")[0] for k in self.strategies]
        if any(k != "ring" for k in kinds):
            unsplit += " (by strategy: " + ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) + ")"
        mixers = f"{self.rings} of {len(self.attention)} attention(s) became ring attention{unsplit}"
        if self.recurrent_calls:
            mixers = ((mixers + "; " if self.attention else "") +
                      f"{len(self.recurrences)} of {self.recurrent_calls} recurrence(s) state-passed")
        return (f"{mixers}; sharded from "
                f"{', '.join(starts) or 'the attention inputs only'}; {len(self.fallbacks)} gather fallback(s); "
                f"{self.sharded_fraction:.0%} of activation bytes held sharded{regions}")


def record_graph(before: fx.GraphModule, after: Optional[fx.GraphModule], ctx: RewriteContext) -> GraphRecord:
    """The :class:`GraphRecord` of ``before`` rewritten into ``after`` (None: not rewritten)."""
    names = {n.name: user_name(n) for n in before.graph.nodes if n.op == "placeholder"}
    rec = GraphRecord(world_size=ctx.group.size, attention=[(n.name, source_line(n)) for n in ctx.attention],
                      shard_inputs={names.get(k, k): d for k, d in ctx.shard_inputs.items()},
                      shard_nodes=dict(ctx.shard_nodes), fallbacks=list(ctx.fallbacks), unsplit=list(ctx.unsplit),
                      regions=[r.describe() for r in ctx.regions], act_bytes_global=_one_device_bytes(before, ctx))
    if after is None:
        rec.act_bytes_local = rec.act_bytes_global
        return rec
    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    rec.rings = sum(n.target is fwd for n in after.graph.nodes)
    rec.masks = mask_forms(after)
    rec.strategies = [strategy_text(ring_call(n), ctx.group.size) for n in after.graph.nodes if n.op == "call_function"
                      and n.target is fwd]
    rec.recurrences = [s.describe() for s in ctx.state_passed]
    rec.recurrent_calls = len(ctx.recurrences)
    rec.act_bytes_local = activation_bytes(after, "val")
    if rec.act_bytes_local == 0:  # no per-rank fake values (repropagate could not run): unknown
        rec.act_bytes_local = rec.act_bytes_global
    _warn_if_low(rec)
    return rec


def strategy_text(call: Any, world: int) -> str:
    """``ring``, ``ulysses u=4`` or ``2d u=2 x r=2``, then why (a ring call's strategy fields)."""
    name = label(call.strategy, call.ulysses, world // call.ulysses)
    return f"{name}: {call.why}" if call.why else name


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _tensor_cost(name: str, held: TensorHeld) -> Tuple[str, int]:
    """``"name (shape) dtype bytes"`` of a tensor argument (its per-rank fake value), and the bytes."""
    if held.shape is None:
        return f"{name} (size unknown)", 0
    return f"{name} {held.shape} {held.dtype} {_human(held.bytes)}", held.bytes


def mask_form(node: fx.Node) -> str:
    """One ring op's mask, :attr:`cp_compile.ring.call_spec.RingCall.mask_form` (``causal`` /
    ``window W`` / ``documents`` / ``explicit`` / ``mask_mod`` / ``score_mod`` joined by ``+``,
    ``full`` when none), and what each rank holds for it."""
    held = ring_tensors(node)
    costs = [_tensor_cost(name, t) for name, t in (("doc_ids", held.doc_ids), ("attn_mask", held.attn_mask))
             if t is not None]
    for key, bufs in (("mask_buffers", held.mask_buffers), ("score_buffers", held.score_buffers)):
        if bufs:
            n = sum(b.bytes for b in bufs)
            costs.append((f"{key} {len(bufs)} tensor(s) {_human(n)}", n))
    held_text = "; per rank: " + ", ".join(c for c, _ in costs) if costs else "; per rank: no mask tensor"
    total = f" (total {_human(sum(n for _, n in costs))})" if len(costs) > 1 else ""
    return ring_call(node).mask_form + held_text + total


def mask_forms(after: fx.GraphModule) -> List[str]:
    """:func:`mask_form` of every ring op of ``after``, in graph order."""
    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    return [mask_form(n) for n in after.graph.nodes if n.op == "call_function" and n.target is fwd]


def _one_device_bytes(before: fx.GraphModule, ctx: RewriteContext) -> int:
    """Activation bytes of ``before`` on one device. Under ``inputs="local"`` the traced graph
    holds this rank's length (a symbol): counted at N times it, the whole sequence."""
    if ctx.options.inputs == "local" and ctx.seq_sym is not None:
        return activation_bytes(before, "example_value", (ctx.seq_sym, ctx.group.size))
    return activation_bytes(before, "example_value")


def warn_whole_sequence(gm: fx.GraphModule, example_inputs: List[object], seq_lens: Set[int],
                        rec: GraphRecord) -> None:
    """A graph without attention that takes activations as long as a sequence an earlier graph
    of this backend split (the logits after a graph break, say) runs on the whole sequence on
    every rank: record those inputs in ``rec.whole_inputs`` and log a WARNING once per graph."""
    from ..passes.analyze.graph_inputs import is_parameter_like

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ex in zip(placeholders, example_inputs):
        if isinstance(ex, torch.Tensor) and not is_parameter_like(node, ex) \
                and any(isinstance(d, int) and d in seq_lens for d in ex.shape):
            rec.whole_inputs.append(f"{user_name(node)} {tuple(ex.shape)}")
    first = next((n for n in gm.graph.nodes if n.op in ("call_function", "call_method")), None)
    key = source_line(first) if first is not None else gm.__class__.__name__
    if not rec.whole_inputs:
        return
    warn_once(log, "whole inputs", key,
              "cp_compile: the graph starting at %s has no attention but takes %s, as long as a sequence an "
              "earlier graph split: every rank runs it on the whole sequence (usually the code after a graph "
              "break, e.g. a loss). Fix: remove the graph break (fullgraph=True shows it), or compute this "
              "part inside the compiled model.", key, ", ".join(rec.whole_inputs))


def warn_no_attention(gm: fx.GraphModule, example_inputs: List[object]) -> None:
    """A graph with no attention, on a CP group, before any graph of this backend had attention
    (a model with none: an RNN, a state-space model; or code before a graph break): compiled
    unchanged, every rank runs it on whole inputs. A WARNING once per graph, when it takes a
    batch (a non-parameter tensor of two dims or more), so no model runs without CP unsaid."""
    from ..passes.analyze.graph_inputs import is_parameter_like

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = [f"{user_name(n)} {tuple(ex.shape)}" for n, ex in zip(placeholders, example_inputs)
             if isinstance(ex, torch.Tensor) and ex.dim() >= 2 and not is_parameter_like(n, ex)]
    first = next((n for n in gm.graph.nodes if n.op in ("call_function", "call_method")), None)
    key = source_line(first) if first is not None else gm.__class__.__name__
    if not batch:
        return
    warn_once(log, "no attention", key,
              "cp_compile: ring_cp found no attention in the graph starting at %s (inputs %s): it is compiled "
              "unchanged and every rank runs it on its whole inputs, with no context parallelism. ring_cp "
              "splits the sequence around attention (scaled_dot_product_attention, flex_attention, or "
              "softmax(q·kᵀ)·v written out); a model without attention (recurrent, state-space, "
              "convolutional) gets none. If this graph is the code before a graph break, fullgraph=True "
              "shows the break.", key, ", ".join(batch))


def _warn_if_low(rec: GraphRecord) -> None:
    """A WARNING when most of a rewritten graph's activation bytes stay whole on every rank."""
    if rec.sharded_fraction >= LOW_SHARDED or not (rec.attention or rec.recurrences):
        return
    key = rec.attention[0][1] if rec.attention else rec.recurrences[0]
    explicit = [m for m in rec.masks if "explicit" in m]
    why = (f"most of it is explicit attention-mask rows ({explicit[0]})" if explicit and not rec.fallbacks
           else "most of it runs on the whole sequence on every rank")
    warn_once(log, "low sharded share", key,
              "cp_compile: the graph with sequence mixers at %s holds only %.0f%% of its activation bytes sharded "
              "(%d gather fallback(s)%s): %s. Fix: see the fallbacks' and masks' warnings, or run "
              "`cp-compile explain` on the model.", key, 100 * rec.sharded_fraction,
              len(rec.fallbacks), "; first: " + rec.fallbacks[0] if rec.fallbacks else "", why)
