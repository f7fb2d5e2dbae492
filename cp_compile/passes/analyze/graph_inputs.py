"""What a graph input is: a forward() argument (and its name), a parameter or buffer, or a
value an earlier graph computed. Read from the Dynamo source Dynamo attaches to each
placeholder (``meta["grapharg"].source``)::

    L['input_ids']                -> a forward() argument named input_ids
    L['kwargs']['labels']         -> the argument labels (Hugging Face's **kwargs wrappers)
    L['self']._modules['wte']...  -> module state: a parameter or buffer

Used by the sequence-input choice (:mod:`.seq_inputs`), the gradient contract of the
rewrite (:mod:`.rewrite`), the masks (:mod:`.masks`) and the record.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from ..context import CPRewriteError, RewriteContext


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
    if ctx.options.grad_sync == "none" and input_kind(node, example) == "unknown":
        raise CPRewriteError(
            f"cp_compile: graph input {node.name} needs a gradient but is neither a Dynamo-traced input nor an "
            "nn.Parameter, so grad_sync='none' cannot tell whether its gradient should stay this rank's share "
            "(a parameter) or be summed over the CP group (an activation from an earlier graph). Fix: "
            "torch._dynamo.config.optimize_ddp = False (keeps DDP's forward one graph), or grad_sync='allreduce'."
        )
