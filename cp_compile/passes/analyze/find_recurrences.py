"""Find every call of a registered recurrent kernel (:func:`cp_compile.register_recurrence`) and
every ``associative_scan`` (one node since :mod:`..normalize.assoc_scan`).

Before: a Dynamo graph, ``ctx.attention`` and ``ctx.seq_len`` found (:mod:`.find_attention`).
After: the same graph; ``ctx.recurrences`` lists the kernel calls. A graph with no attention takes
its sequence length S from them (their declared sequence dims must agree); a graph with both must
have the recurrences run along the attention's sequence. :func:`mixer_inputs` is what the analyses
of where the sequence enters (:mod:`.seq_inputs`, :mod:`.seq_origins`) trace back from: attention's
q/k/v and the recurrences' per-token arguments.
"""

from __future__ import annotations

from typing import Set

import torch
import torch.fx as fx

from ...recurrence import recurrence_spec
from ...recurrence.decay_scan import is_decay_scan
from ...recurrence.loops import is_loop_kernel
from ...recurrence.scan import scan_leaves
from ..context import CPRewriteError, RewriteContext, global_shape, log, source_line
from ..op_vocab import arguments
from .find_attention import qkv_args


def is_recurrence(node: fx.Node) -> bool:
    """Whether ``node`` calls a kernel registered with :func:`cp_compile.register_recurrence`."""
    return node.op == "call_function" and recurrence_spec(node.target) is not None


def is_scan(node: fx.Node) -> bool:
    """Whether ``node`` is an ``associative_scan`` (:mod:`..normalize.assoc_scan` made it one node)."""
    return node.op == "call_function" and node.target is scan_leaves


def _name(node: fx.Node) -> str:
    return "associative_scan" if is_scan(node) else recurrence_spec(node.target).name


def sequence_args(node: fx.Node) -> dict:
    """A recurrence node's per-token graph arguments: node -> its declared sequence dim (a scan's
    leaves: dim 0)."""
    return dict(_named_sequence_args(node).values())


def _named_sequence_args(node: fx.Node) -> dict:
    """:func:`sequence_args` by parameter name (a scan's leaves: their positions)."""
    if is_scan(node):
        return {str(i): (x, 0) for i, x in enumerate(node.args[1])}
    spec = recurrence_spec(node.target)
    a = arguments(node, spec.parameters())
    return {name: (a[name], dim) for name, dim in spec.seq_args.items() if isinstance(a.get(name), fx.Node)}


def mixer_inputs(ctx: RewriteContext) -> Set[fx.Node]:
    """The nodes the sequence mixers read per token: attention's q/k/v, the recurrences' seq args."""
    nodes = {n for a in ctx.attention for n in qkv_args(a)}
    return nodes | {x for r in ctx.recurrences for x in sequence_args(r)}


def _length(node: fx.Node) -> int:
    """The one sequence length of a recurrence node's per-token arguments."""
    lens = set()
    for name, (x, dim) in _named_sequence_args(node).items():
        shape = global_shape(x)
        seq = x.meta["example_value"].shape[dim]
        if isinstance(seq, torch.SymInt):
            raise CPRewriteError(
                f"cp_compile: recurrent kernel {_name(node)} at {source_line(node)} runs on a "
                "symbolic sequence length; state passing needs a fixed one. Fix: torch.compile(..., dynamic=False).")
        if is_loop_kernel(node.target):  # (its reads: positions, chunks of tokens, or entries of chunks)
            lens.add(node.target.tokens(name, shape[dim]))
        else:  # (a scan over chunks: their tokens)
            lens.add(shape[dim] * getattr(node.target, "tokens_per_entry", 1))
    if len(lens) != 1:
        raise CPRewriteError(
            f"cp_compile: recurrent kernel {_name(node)} at {source_line(node)} takes per-token "
            f"arguments of lengths {sorted(lens)} along their declared sequence dims. Fix: check seq_args= of its "
            "register_recurrence call (parameter name -> the dim along which the tokens run).")
    return lens.pop()


def find_recurrences(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Fill ``ctx.recurrences`` (and ``ctx.seq_len`` when the graph has no attention). A scan along
    another length than the sequence's (its features), or a folded loop over one, is per token, not a
    recurrence over the tokens."""
    found = [n for n in gm.graph.nodes if is_recurrence(n) or is_scan(n)]
    lens = {n: _length(n) for n in found}
    if not ctx.attention and lens:
        ctx.seq_len = max(lens.values())
    own = {n for n in found if is_scan(n) or is_loop_kernel(n.target) or is_decay_scan(n.target)}  # not registered
    ctx.recurrences = [n for n in found if n not in own or lens[n] == ctx.seq_len]
    other = {n.name: s for n, s in lens.items() if s != ctx.seq_len and n not in own}
    if other:
        raise CPRewriteError(
            f"cp_compile: recurrent kernels {sorted(other)} run along lengths {sorted(set(other.values()))}, not the "
            f"sequence's {ctx.seq_len}. Fix: compile models whose sequence mixers share one sequence.")
    if ctx.recurrences:
        log.info("cp_compile: %d recurrence(s), sequence length %d", len(ctx.recurrences), ctx.seq_len)


__all__ = ["find_recurrences", "is_recurrence", "is_scan", "mixer_inputs", "sequence_args"]
