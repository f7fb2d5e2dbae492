"""Shard where the sequence arises, when no graph input carries it.

Before: ``ctx.shard_inputs`` chosen (:mod:`.seq_inputs`) and empty: no input has
attention's length S along a dim that reaches q/k/v. That is the case when the sequence
is assembled inside the model: a cls (or register, prompt) token concatenated before
S-1 patch or token embeddings, image and text embeddings concatenated. After:
``ctx.shard_nodes`` maps each *origin* to its sequence dim; the rewrite keeps an origin
whole where it is computed and indexes it by this rank's positions right after, so every
op from there to the attention holds 1/N of the tokens::

    patches (B, S-1, P) ─ linear ─ cat([cls, ·], dim=1) (B, S, D) ─ this rank's rows ─> (B, S/N, D) ─ ...

An origin is a node that feeds an attention's q/k/v, has exactly one dim of size S,
takes at least one tensor, and takes none with a dim of size S (so the sequence is born
there: factories such as ``arange(S)`` are left to the position rule, which indexes them
where they meet sharded values). The rewrite selects the rows as far upstream as is cheap
(:mod:`.row_select`): into the pieces of a ``cat`` and through the per-token ops that made
them, so with static shapes each rank embeds only its own patches. A patch-embedding
convolution (stride = kernel) upstream was opened into patches + linear by the pass before
(:mod:`..normalize.patch_conv`), so the selection reaches the image: each rank reads only its patches.
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx

from typing import Set

from ..context import RewriteContext, global_shape, log, source_line
from .find_recurrences import mixer_inputs
from .seq_inputs import _dataflow


def needs_origins(ctx: RewriteContext) -> bool:
    """Whether the sequence must be sharded where it arises: no input is sharded (and inputs are full)."""
    return not ctx.shard_inputs and ctx.options.inputs == "full"


def qkv_feeds(gm: fx.GraphModule, ctx: RewriteContext) -> Set[fx.Node]:
    """Every node some attention's q, k or v (or a recurrence's per-token argument) is computed from,
    those included."""
    flow = _dataflow(gm)
    return set().union(*(nx.ancestors(flow, n) | {n} for n in mixer_inputs(ctx)))


def _origin_dim(node: fx.Node, seq_len: int):
    """The sequence dim of ``node`` if the sequence is born there, else None."""
    shape = global_shape(node)
    if node.op not in ("call_function", "call_method") or shape is None or list(shape).count(seq_len) != 1:
        return None
    tensors = [global_shape(a) for a in node.all_input_nodes]
    tensors = [s for s in tensors if s is not None and len(s) > 0]
    if not tensors or any(seq_len in s for s in tensors):
        return None
    return list(shape).index(seq_len)


def choose_seq_origins(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Fill ``ctx.shard_nodes`` when no input is sharded (see the module docstring)."""
    if not needs_origins(ctx):
        return
    feeds = qkv_feeds(gm, ctx)
    for node in gm.graph.nodes:  # graph order: the earliest origins first
        dim = _origin_dim(node, ctx.seq_len) if node in feeds else None
        if dim is not None:
            ctx.shard_nodes[node.name] = dim
            log.info("cp_compile: the sequence arises at %s (%s): sharded there, dim %d",
                     node.name, source_line(node), dim)
