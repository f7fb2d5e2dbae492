"""Attention with a function of the scores before the softmax (Gemma 2's and Grok's soft-capping).

    w = softmax(f(q·kᵀ·scale) + mask);  out = w·v          f elementwise: c·tanh(s / c), clamp, ...

SDPA has no place for f. When :mod:`.attention_match` finds a nonlinear elementwise function of
the scores between the product and the softmax, :mod:`.fuse_attention` emits
:func:`scaled_dot_product_attention_with_scores` instead of SDPA: SDPA's own arguments, and f as a
GraphModule of one input (``score_fn``). :mod:`.find_attention` treats the call as SDPA (its mask
is analysed the same way), and the ring rule (:mod:`.rules.attention`) hands f to the ring op as
the first part of its score_mod (:mod:`cp_compile.ring.mods`), applied to every rectangle's fp32
scores before the mask's additive terms, as here. Run as it is (before the rewrite, or in tests)
the function computes the same attention densely, so the fused graph means what the model did.
"""

from __future__ import annotations

import math
import operator
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx

Tensor = torch.Tensor


def scaled_dot_product_attention_with_scores(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
    score_fn: torch.nn.Module,
) -> Tensor:
    """``softmax(score_fn(q·kᵀ·scale) + attn_mask)·v``, densely (fp32 scores for half inputs); the
    arguments are SDPA's (a boolean mask keeps where True), ``score_fn`` elementwise."""
    if dropout_p or enable_gqa:
        raise ValueError("scaled_dot_product_attention_with_scores: no dropout, no enable_gqa (q, k, v heads equal)")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    acc = torch.promote_types(query.dtype, torch.float32)
    s = score_fn(torch.matmul(query.to(acc), key.to(acc).transpose(-2, -1)) * scale)  # (B, H, L, S)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype is torch.bool else s + attn_mask
    return torch.matmul(torch.softmax(s, dim=-1).to(value.dtype), value)


def build_score_fn(steps: List[Tuple[float, fx.Node, Any]]) -> fx.GraphModule:
    """f as a GraphModule of the score: ``steps`` from the outermost op inwards, each (the scale
    applied after it, the op's node, the argument that is the scores), re-run innermost first."""
    graph = fx.Graph()
    x = graph.placeholder("score")
    for mult, node, scores in reversed(steps):
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: x if a is scores else a)
        x = graph.create_node(node.op, node.target, args, kwargs)
        if mult != 1.0:
            x = graph.call_function(operator.mul, (x, mult))
    graph.output(x)
    return fx.GraphModule(torch.nn.Module(), graph)


__all__ = ["build_score_fn", "scaled_dot_product_attention_with_scores"]
