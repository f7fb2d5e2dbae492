"""Graphs without attention: each parameter's gradient becomes this rank's CP share.

When FSDP2's per-layer hooks, a graph break or DDPOptimizer split a model into
several graphs, the pieces without attention (the embedding; the final norm, head
and loss) are not rewritten: every rank of the CP group runs them on values it holds
whole (with ``inputs="full"`` and ``outputs="full"`` every graph input is the full
sequence), so every rank computes the *full* gradient of their parameters.

* ``grad_sync="allreduce"``: that full gradient is what the caller needs; the graph
  goes to the inner compiler unchanged.
* ``grad_sync="none"``: DDP/FSDP sums every parameter gradient over the CP ranks, so
  each rank must hold a share. Before: ``linear(x, w)``; after:
  ``linear(x, grad_scale(w, 1/N))``, an identity forward whose backward multiplies by
  1/N, traced into the backward graph by AOTAutograd like the other
  :mod:`cp_compile.graph_ops`. Shares add up across graphs, so a parameter used both
  here and in a rewritten graph (tied embedding and head) still sums to its gradient.
  Inputs that are not parameters (forward() arguments, activations from an earlier
  piece) keep their full gradient, as the graph that produced them expects.

Only uses where autograd records (grad mode on, tracked through Dynamo's
``torch._C._set_grad_enabled`` nodes) are wrapped: an optimizer step compiled by
the same backend reads parameters under ``no_grad`` and is left alone. With
``inputs="local"`` or ``outputs="local"`` a graph without attention may see this
rank's shard or the whole sequence, which decides whether its parameter gradients
are already shares; that cannot be told from the graph, so it is refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ... import graph_ops
from ..context import CPRewriteError, RewriteContext, log, source_line
from ..analyze.graph_inputs import is_parameter_like, refuse_unknown


def grad_enabled_nodes(gm: fx.GraphModule) -> Set[fx.Node]:
    """The nodes that run with grad mode on: the mode the graph starts in (Dynamo compiles in
    the caller's mode and guards on it), switched by ``torch._C._set_grad_enabled`` nodes."""
    enabled, out = torch.is_grad_enabled(), set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif enabled:
            out.add(node)
    return out


def _parameters_with_grad(gm: fx.GraphModule, examples: Dict[str, Any],
                          ctx: RewriteContext) -> Dict[fx.Node, List[fx.Node]]:
    """Parameter inputs that need a gradient -> their users that run with grad mode on."""
    recording = grad_enabled_nodes(gm)
    found: Dict[fx.Node, List[fx.Node]] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        example = examples.get(node.name)
        if not (isinstance(example, torch.Tensor) and example.requires_grad):
            continue
        refuse_unknown(node, example, ctx)
        users = [u for u in node.users if u in recording]
        if users and is_parameter_like(node, example):
            found[node] = users
    return found


def share_parameter_grads(gm: fx.GraphModule, example_inputs: List[Any],
                          ctx: RewriteContext) -> Optional[fx.GraphModule]:
    """A copy of ``gm`` (a graph without attention) whose parameters get 1/N of their
    gradient, or None when it needs no change (no parameter gradients, or grad_sync="allreduce")."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    examples = {n.name: ex for n, ex in zip(placeholders, example_inputs)}
    params = _parameters_with_grad(gm, examples, ctx)
    if not params:
        return None
    if "local" in (ctx.options.inputs, ctx.options.outputs):
        first_use = source_line(next(iter(params.values()))[0])
        raise CPRewriteError(
            f"cp_compile: a graph without attention computes gradients of parameters "
            f"{sorted(n.name for n in params)[:4]} (first used at {first_use}) under inputs='{ctx.options.inputs}', "
            f"outputs='{ctx.options.outputs}': its values "
            "may be this rank's shard or the whole sequence, which cannot be told, so its gradients could come out "
            "wrong. Fix: compile the model as one graph (fullgraph=True; remove the graph break; with DDP "
            "torch._dynamo.config.optimize_ddp = False), or inputs='full' and outputs='full'."
        )
    if ctx.options.grad_sync == "allreduce":
        return None
    new_gm, renamed = _copy(gm)
    first_op = next(n for n in new_gm.graph.nodes if n.op != "placeholder")
    for old, users in params.items():
        node = renamed[old]
        with new_gm.graph.inserting_before(first_op):
            share = new_gm.graph.call_function(graph_ops.grad_scale, (node, 1.0 / ctx.world))
        share.meta = {k: v for k, v in node.meta.items() if k in ("example_value", "val")}
        for user in users:
            renamed[user].replace_input_with(node, share)
    new_gm.recompile()
    log.info("cp_compile: no attention in this graph: %d parameter gradient(s) scaled to this rank's 1/%d share "
             "(grad_sync='none')", len(params), ctx.world)
    return new_gm


def _copy(gm: fx.GraphModule) -> Tuple[fx.GraphModule, Dict[fx.Node, fx.Node]]:
    """A new GraphModule with a node-for-node copy of ``gm``'s graph (meta copied), and the
    map old node -> new node (the output node included)."""
    graph, env = fx.Graph(), {}
    out = graph.output(graph.graph_copy(gm.graph, env))
    env[next(iter(gm.graph.find_nodes(op="output")))] = out
    return fx.GraphModule(gm, graph), env
