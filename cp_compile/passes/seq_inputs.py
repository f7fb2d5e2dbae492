"""Pass 2: decide which graph inputs carry the sequence (and along which dim).

Before: a graph with ``ctx.attention`` found. After: ``ctx.shard_inputs`` maps
placeholder names to their sequence dim. ``seq_inputs="auto"`` picks the user
inputs (never parameters or buffers) that reach the q/k/v of an attention and have
a dim of size S (several such dims: settled by :func:`resolve_candidates`); a
mapping ``{"input_ids": 1, ...}`` (argument names) always wins. Inputs left out stay Global and are indexed by position where they
meet sharded values, which is also exact.
"""

from __future__ import annotations

import re
from itertools import product
from typing import Callable, Dict, Optional

import networkx as nx
import torch
import torch.fx as fx

from .context import CPRewriteError, RewriteContext, global_shape, log
from .find_attention import is_sdpa, sdpa_arg


def _source_name(node: fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return str(node.target)
    name = source.name
    return name() if callable(name) else str(name)


# A forward() argument, possibly inside a container: L['x'], L['kwargs']['x'] (Hugging Face's
# forward wrappers take **kwargs), L['batch']['input_ids'], L['args'][0]. Module state is
# reached through L['self'] attributes and globals through G[...].
_USER_SOURCE = re.compile(r"L\['(?!self')[^']+'\](\[[^\]]+\])*")


def user_name(node: fx.Node) -> str:
    """The argument name behind a Dynamo placeholder (``L['input_ids']``, ``L['kwargs']['input_ids']``
    -> ``input_ids``)."""
    name = _source_name(node)
    m = re.fullmatch(r"L\['([^']+)'\]|L\['kwargs'\]\['([^']+)'\]", name)
    return next(g for g in m.groups() if g) if m else name


def is_parameter_like(node: fx.Node, example: Optional[torch.Tensor]) -> bool:
    """Parameters, module buffers and anything else that is not a forward() argument."""
    if isinstance(example, torch.nn.Parameter):
        return True
    return _USER_SOURCE.fullmatch(_source_name(node)) is None


def _dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    """Value flow between nodes, except from an attention mask into its attention: a mask
    input (``attention_mask``) decides what attends to what, it does not carry tokens,
    even though it reaches the next layer's q/k/v through this layer's output."""
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for user in n.users:
            if not (is_sdpa(user) and n is sdpa_arg(user, 3, "attn_mask") and n not in _qkv(user)):
                g.add_edge(n, user)
    return g


def _qkv(node: fx.Node) -> tuple:
    return tuple(sdpa_arg(node, i, name) for i, name in enumerate(("query", "key", "value")))


def choose_seq_inputs(gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, torch.Tensor]) -> fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_user = {user_name(n): n for n in placeholders}
    if isinstance(ctx.seq_inputs, dict):
        unknown = set(ctx.seq_inputs) - set(by_user)
        if unknown:
            raise CPRewriteError(
                f"cp_compile: seq_inputs names {sorted(unknown)} are not inputs of the compiled graph "
                f"(inputs: {sorted(by_user)}). Fix: use the forward() argument names."
            )
        ctx.shard_inputs = {by_user[k].name: dim % len(global_shape(by_user[k])) for k, dim in ctx.seq_inputs.items()}
        return gm
    flow = _dataflow(gm)
    qkv = {n for a in ctx.attention for n in _qkv(a)}
    feeds = set().union(*(nx.ancestors(flow, n) | {n} for n in qkv)) if qkv else set()
    for n in placeholders:
        shape = global_shape(n)
        reaches = n in feeds or ctx.inputs == "local"  # local: every per-token input is already a shard
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
