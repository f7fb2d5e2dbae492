"""Decide which graph inputs carry the sequence (and along which dim).

Before: a graph with ``ctx.attention`` found. After: ``ctx.shard_inputs`` maps
placeholder names to their sequence dim. ``seq_inputs="auto"`` picks the user
inputs and the values an earlier graph computed (a DDPOptimizer piece's inputs; never
parameters or buffers, see :func:`input_kind`) that reach the q/k/v of an attention
and have a dim of size S (several such dims: settled by :func:`resolve_candidates`);
a mapping ``{"input_ids": 1, ...}`` (argument names) always wins. Inputs left out
stay Global and are indexed by position where they meet sharded values, which is
also exact.
"""

from __future__ import annotations

from itertools import product
from typing import Any, Callable, Dict

import networkx as nx
import torch
import torch.fx as fx

from ..context import CPRewriteError, RewriteContext, global_shape, log
from .find_attention import is_sdpa, qkv_args
from .find_recurrences import mixer_inputs
from .graph_inputs import input_kind, is_parameter_like, refuse_unknown, user_name  # noqa: F401 (re-exported)


def refuse_split_inputs(gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, Any]) -> None:
    """Inputs an earlier graph computed (DDPOptimizer pieces) arrive at the full sequence: they
    are sharded here like forward() arguments. That is right only when the earlier piece returned
    full values and the inputs cannot be named by the user."""
    computed = [n.name for n in gm.graph.nodes if n.op == "placeholder"
                and isinstance(examples.get(n.name), torch.Tensor) and input_kind(n, examples[n.name]) == "computed"]
    if not computed:
        return
    if "local" in (ctx.options.inputs, ctx.options.outputs):
        why = ("inputs='local' / outputs='local' keep this rank's shard across the split, where the next piece "
               "would take it for the whole sequence")
    elif isinstance(ctx.options.seq_inputs, dict):
        why = (f"seq_inputs={ctx.options.seq_inputs} names forward() arguments, while this piece's sequence inputs are "
               "values the previous piece computed")
    else:
        return
    raise CPRewriteError(
        f"cp_compile: this graph is a piece of a larger one (DDPOptimizer split it at a DDP bucket boundary; "
        f"inputs {computed} come from the previous piece), and {why}. Fix: torch._dynamo.config.optimize_ddp "
        "= False (one graph), or the defaults inputs='full', outputs='full', seq_inputs='auto'."
    )


def _dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    """Value flow between nodes, except from what enters an attention other than as q/k/v (an SDPA
    ``attn_mask``; FlexAttention's block-mask tensors and mod buffers, e.g. document ids): it decides
    what attends to what, it does not carry tokens, even though it reaches the next layer's q/k/v
    through this layer's output. Such an input stays whole on every rank, where the ring op wants it."""
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for user in n.users:
            if not (is_sdpa(user) and n not in qkv_args(user)):
                g.add_edge(n, user)
    return g


def choose_seq_inputs(gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, torch.Tensor]) -> fx.GraphModule:
    """Fill ``ctx.shard_inputs`` (a mapping) or ``ctx.shard_candidates`` (auto), see the module docstring."""
    refuse_split_inputs(gm, ctx, examples)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_user = {user_name(n): n for n in placeholders}
    if isinstance(ctx.options.seq_inputs, dict):
        unknown = set(ctx.options.seq_inputs) - set(by_user)
        if unknown:
            raise CPRewriteError(
                f"cp_compile: seq_inputs names {sorted(unknown)} are not inputs of the compiled graph "
                f"(inputs: {sorted(by_user)}). Fix: use the forward() argument names."
            )
        ctx.shard_inputs = {by_user[k].name: dim % len(global_shape(by_user[k]))
                            for k, dim in ctx.options.seq_inputs.items()}
        return gm
    flow = _dataflow(gm)
    mixed = mixer_inputs(ctx)
    feeds = set().union(*(nx.ancestors(flow, n) | {n} for n in mixed)) if mixed else set()
    for n in placeholders:
        shape = global_shape(n)
        reaches = n in feeds or ctx.options.inputs == "local"  # local: every per-token input is already a shard
        if not reaches or shape is None or is_parameter_like(n, examples.get(n.name)):
            continue
        dims = [d for d, size in enumerate(shape) if size == ctx.seq_len]
        if dims:
            ctx.shard_candidates[n.name] = dims
    return gm


def resolve_candidates(ctx: RewriteContext, works: Callable[[Dict[str, int]], bool], gm: fx.GraphModule) -> None:
    """Pick one sequence dim per input. Inputs with several dims of size S (hidden size
    equal to S, say) are settled by trial: the choice under which the whole graph
    rewrites without any gather is the one whose dim reaches attention's sequence axis."""
    names = {n.name: user_name(n) for n in gm.graph.nodes if n.op == "placeholder"}
    choices = [dict(zip(ctx.shard_candidates, combo)) for combo in product(*ctx.shard_candidates.values())]
    good = [c for c in choices if len(choices) == 1 or works(c)]
    if len(good) != 1:
        amb = {names[k]: v for k, v in ctx.shard_candidates.items() if len(v) > 1}
        raise CPRewriteError(
            f"cp_compile: cannot tell the sequence dim of inputs {amb} ({len(good)} choices rewrite cleanly). "
            f"Fix: name it, e.g. options={{'seq_inputs': {{'{next(iter(amb), 'x')}': DIM}}}}."
        )
    ctx.shard_inputs = good[0]
    log.info("cp_compile: sharding inputs %s", {names[k]: d for k, d in ctx.shard_inputs.items()})
