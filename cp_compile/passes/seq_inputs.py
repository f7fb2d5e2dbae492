"""Pass 2: decide which graph inputs carry the sequence (and along which dim).

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

import re
from itertools import product
from typing import Any, Callable, Dict

import networkx as nx
import torch
import torch.fx as fx

from .context import CPRewriteError, RewriteContext, global_shape, log
from .find_attention import is_sdpa, qkv_args, sdpa_arg


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


def input_kind(node: fx.Node, example: Any) -> str:
    """What a graph input is, for the gradient contract and for sharding.

    * ``"parameter"``: an ``nn.Parameter`` (Dynamo lifts them as inputs, fake or real, the
      Parameter class kept), a module buffer or another global (its Dynamo source is not a
      forward() argument);
    * ``"user"``: a forward() argument (Dynamo source ``L['name']``);
    * ``"computed"``: a value an earlier graph computed. DDPOptimizer splits Dynamo's graph
      at DDP bucket boundaries and hands each piece over on its own; the inputs of a later
      piece are nodes of the original graph, with its ``example_value`` but no ``grapharg``
      (no Dynamo source), and their examples are the earlier piece's fake outputs: tensors
      with an autograd history (or that need no gradient);
    * ``"unknown"``: no Dynamo source and a leaf tensor that needs a gradient but is not a
      Parameter: a weight or an activation, cannot be told (see :func:`refuse_unknown`).
    """
    if isinstance(example, torch.nn.Parameter):
        return "parameter"
    if "grapharg" in node.meta:
        return "user" if _USER_SOURCE.fullmatch(_source_name(node)) else "parameter"
    if isinstance(example, torch.Tensor) and example.requires_grad and example.grad_fn is None:
        return "unknown"
    return "computed"


def is_parameter_like(node: fx.Node, example: Any) -> bool:
    """Parameters, module buffers and anything else that is neither a forward() argument nor
    a value an earlier graph computed (an unknown input counts as a parameter, as it always did)."""
    return input_kind(node, example) in ("parameter", "unknown")


def refuse_unknown(node: fx.Node, example: Any, ctx: RewriteContext) -> None:
    """Under ``grad_sync="none"`` a parameter's gradient stays this rank's share and any other
    input's is summed over the group: an input that could be either must not be guessed."""
    if ctx.grad_sync == "none" and input_kind(node, example) == "unknown":
        raise CPRewriteError(
            f"cp_compile: graph input {node.name} needs a gradient but is neither a Dynamo-traced input nor an "
            "nn.Parameter, so grad_sync='none' cannot tell whether its gradient should stay this rank's share "
            "(a parameter) or be summed over the CP group (an activation from an earlier graph). Fix: "
            "torch._dynamo.config.optimize_ddp = False (keeps DDP's forward one graph), or grad_sync='allreduce'."
        )


def refuse_split_inputs(gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, Any]) -> None:
    """Inputs an earlier graph computed (DDPOptimizer pieces) arrive at the full sequence: they
    are sharded here like forward() arguments. That is right only when the earlier piece returned
    full values and the inputs cannot be named by the user."""
    computed = [n.name for n in gm.graph.nodes if n.op == "placeholder"
                and isinstance(examples.get(n.name), torch.Tensor) and input_kind(n, examples[n.name]) == "computed"]
    if not computed:
        return
    if "local" in (ctx.inputs, ctx.outputs):
        why = ("inputs='local' / outputs='local' keep this rank's shard across the split, where the next piece "
               "would take it for the whole sequence")
    elif isinstance(ctx.seq_inputs, dict):
        why = (f"seq_inputs={ctx.seq_inputs} names forward() arguments, while this piece's sequence inputs are "
               "values the previous piece computed")
    else:
        return
    raise CPRewriteError(
        f"cp_compile: this graph is a piece of a larger one (DDPOptimizer split it at a DDP bucket boundary; "
        f"inputs {computed} come from the previous piece), and {why}. Fix: torch._dynamo.config.optimize_ddp "
        "= False (one graph), or the defaults inputs='full', outputs='full', seq_inputs='auto'."
    )


def _dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    """Value flow between nodes, except from an attention mask into its attention: a mask
    input (``attention_mask``) decides what attends to what, it does not carry tokens,
    even though it reaches the next layer's q/k/v through this layer's output."""
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        g.add_node(n)
        for user in n.users:
            if not (is_sdpa(user) and n is sdpa_arg(user, 3, "attn_mask") and n not in qkv_args(user)):
                g.add_edge(n, user)
    return g


def choose_seq_inputs(gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, torch.Tensor]) -> fx.GraphModule:
    """Fill ``ctx.shard_inputs`` (a mapping) or ``ctx.shard_candidates`` (auto), see the module docstring."""
    refuse_split_inputs(gm, ctx, examples)
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
    qkv = {n for a in ctx.attention for n in qkv_args(a)}
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
