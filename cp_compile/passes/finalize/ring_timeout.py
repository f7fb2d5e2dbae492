"""The backend's ``timeout`` on every ring op of the rewritten graph.

Before: ``ring_attention_fwd(q, k, v, ...)`` with the op's default (no timeout: the process
group's own). After, under ``timeout=T``::

    ring_attention_fwd(q, k, v, ..., timeout=T)

The backward inherits it through the op's autograd. Every GraphModule under the graph is
visited (a subgraph's ring ops too). Without a timeout the graph is left untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import RewriteContext
from ..ring_call import pass_timeout


def set_ring_timeout(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Give every ring op of ``gm`` (and of its submodules) ``ctx.options.timeout`` seconds."""
    timeout = ctx.options.timeout
    if timeout is None:
        return
    fwd = torch.ops.cp_compile.ring_attention_fwd.default
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=fwd):
                pass_timeout(node, timeout)  # the op's argument and its recorded RingCall alike
            module.recompile()
