"""Attention that ring_cp cannot see: say so, never let it run whole in silence.

Before: a Dynamo graph in which :func:`.find_attention.find_attention` found no
``scaled_dot_product_attention``. After: the same graph, and ``ctx.unsplit`` lists each
op that computes attention another way, with its source line and the fix:

* ``nn.MultiheadAttention`` / ``nn.Transformer*`` layers: Dynamo keeps
  ``F.multi_head_attention_forward`` as one opaque node (:mod:`.expand_mha` opens every
  one it can, and :mod:`.expand_fastpath` opens the eval-mode fast paths or refuses them);
* attention written by hand: a softmax over the last dim of an (..., L, L) matmul product.

Each is logged as a WARNING once per source line (the backend then compiles the graph
unchanged: every rank runs it on the whole sequence), or raised under ``strict=True``.
``cp-compile explain`` prints ``ctx.unsplit`` from this same pass.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Set

import torch
import torch.fx as fx

from .context import CPRewriteError, RewriteContext, fake_value, log, source_line

OPAQUE_ATTENTION = ("multi_head_attention_forward",)
SOFTMAX = ("softmax", "_softmax")
MATMUL = {torch.matmul, operator.matmul, torch.bmm, torch.einsum, "matmul", "bmm"}
HOPS = 4  # how far above a softmax its scores may come from a matmul (scale, mask, cast in between)

_warned: Set[str] = set()


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _from_matmul(node: fx.Node, hops: int = HOPS) -> bool:
    """Whether ``node`` is, or is a few ops below, a matmul / bmm / einsum."""
    if node.op in ("call_function", "call_method") and node.target in MATMUL:
        return True
    return hops > 0 and any(_from_matmul(a, hops - 1) for a in node.all_input_nodes)


def _hand_written(node: fx.Node) -> bool:
    """softmax over the last dim of scores (..., L, L) computed by a matmul: attention by hand."""
    if node.op not in ("call_function", "call_method") or _name(node) not in SOFTMAX or not node.all_input_nodes:
        return False
    scores = fake_value(node.all_input_nodes[0])
    if not isinstance(scores, torch.Tensor) or scores.dim() < 2 or scores.shape[-1] != scores.shape[-2]:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return dim in (-1, scores.dim() - 1) and _from_matmul(node.all_input_nodes[0])


def _why(node: fx.Node) -> Optional[str]:
    name = _name(node)
    if node.op == "call_function" and any(op in name for op in OPAQUE_ATTENTION):
        return (f"{name} (nn.MultiheadAttention / nn.Transformer* layers) is one opaque op to ring_cp. Fix: "
                "write the layer's attention with F.scaled_dot_product_attention (its q/k/v projections as "
                "nn.Linear), which ring_cp turns into ring attention")
    if _hand_written(node):
        return ("a softmax over (..., L, L) scores from a matmul looks like attention written by hand. Fix: "
                "F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...) computes the same "
                "without the L x L scores, and ring_cp turns it into ring attention")
    return None


def find_unsplit_attention(gm: fx.GraphModule, ctx: RewriteContext) -> List[str]:
    """Fill ``ctx.unsplit`` with the attention ops ring_cp cannot split; warn (or raise under strict)."""
    ctx.unsplit = [f"{source_line(n)}: {why}" for n in gm.graph.nodes for why in [_why(n)] if why]
    for line in ctx.unsplit:
        message = (f"cp_compile: attention that ring_cp cannot split, at {line}. This graph gets no context "
                   "parallelism: every rank runs it on the whole sequence.")
        if ctx.strict:
            raise CPRewriteError(message + " (strict=True)")
        if line not in _warned:
            _warned.add(line)
            log.warning(message)
    return ctx.unsplit
