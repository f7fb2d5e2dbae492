"""Find every scaled_dot_product_attention (and flex_attention) and the sequence length S.

Before: a Dynamo graph (its masks' views moved onto their terms, :mod:`..normalize.mask_views`).
After: the same graph (the mask analysis adds only the ``~m`` terms it names and routes the
document ids' inputs through ``whole``, :mod:`.masks`); ``ctx.attention`` lists the SDPA and FlexAttention nodes and
``ctx.seq_len`` is their common sequence length (q, k and v all (B, H, S, D)); a flex_attention
node carries its parsed mods (:mod:`.find_flex`, in its node facts), whose BlockMask the pass
:mod:`..normalize.block_masks` then drops; ``ctx.masks`` says, for each attention given a mask,
what the ring op makes of it:
causal, full or a causal sliding window, and the terms it must apply as an explicit
mask (:mod:`.masks`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import CPRewriteError, RewriteContext, global_shape, log, source_line
from .find_flex import is_flex, parse_flex
from .masks.classify import classify_mask
from ..op_vocab import SDPA_PARAMS, SDPA_TARGETS, arguments



def is_sdpa(node: fx.Node) -> bool:
    """Whether ``node`` is attention the ring replaces: scaled_dot_product_attention, or FlexAttention's
    higher-order op (q, k, v are its first three arguments too; its rule is rules/flex.py)."""
    return node.op == "call_function" and (node.target in SDPA_TARGETS or is_flex(node))


def qkv_args(node: fx.Node) -> tuple:
    """(query, key, value) of an SDPA node (or of flex_attention, whose first three arguments they are too)."""
    a = arguments(node, SDPA_PARAMS)
    return a["query"], a["key"], a["value"]


def _check_flex(gm: fx.GraphModule, node: fx.Node, ctx: RewriteContext) -> int:
    """S of a flex_attention node, after parsing its mods (refusing what the ring cannot honour)."""
    seq = node.args[0].meta["example_value"].shape[2]
    if isinstance(seq, torch.SymInt):
        ctx.seq_sym = seq
    parse_flex(gm, node)  # checks q/k/v shapes first
    return global_shape(node.args[0])[2]


def _check_supported(node: fx.Node, ctx: RewriteContext) -> int:
    where = source_line(node)
    dropout = arguments(node, SDPA_PARAMS).get("dropout_p", 0.0)
    if isinstance(dropout, fx.Node):  # dynamic=True with specialize_float=False: a float attribute is an input
        raise CPRewriteError(
            f"cp_compile: scaled_dot_product_attention at {where} takes dropout_p as a graph input "
            f"({dropout.name}): under dynamic shapes Dynamo traces float attributes such as a config's "
            "attention_dropout symbolically, so its value (even 0.0) is unknown here. Fix: "
            "torch._dynamo.config.specialize_float = True before compiling, or set attention dropout to 0 "
            "as a literal (e.g. model.eval())."
        )
    if not isinstance(dropout, (int, float)) or dropout != 0.0:
        raise CPRewriteError(
            f"cp_compile: scaled_dot_product_attention with dropout_p={dropout} at {where} is not supported. "
            "Fix: set attention dropout to 0 (or model.eval())."
        )
    shapes = [global_shape(x) for x in qkv_args(node)]
    seq = qkv_args(node)[0].meta["example_value"].shape[2]
    if isinstance(seq, torch.SymInt):
        ctx.seq_sym = seq
    if any(s is None or len(s) != 4 for s in shapes):
        raise CPRewriteError(f"cp_compile: scaled_dot_product_attention at {where} must take 4-D (B, H, S, D) q/k/v.")
    lens = {s[2] for s in shapes}
    if len(lens) != 1:
        raise CPRewriteError(
            f"cp_compile: scaled_dot_product_attention at {where} has q/k/v sequence lengths {sorted(lens)}; "
            "context parallelism needs self-attention over one sequence (cross-attention is not supported)."
        )
    seq_len = lens.pop()
    _check_mask(node, ctx, seq_len)
    return seq_len


def _check_mask(node: fx.Node, ctx: RewriteContext, seq_len: int) -> None:
    """Record what the attn_mask of ``node`` means for the ring op (masks.py)."""
    a = arguments(node, SDPA_PARAMS)
    mask = a.get("attn_mask")
    if mask is None:
        return
    if not isinstance(mask, fx.Node) or a.get("is_causal", False):
        raise CPRewriteError(
            f"cp_compile: scaled_dot_product_attention at {source_line(node)} takes an attn_mask together with "
            "is_causal=True (or a mask that is not a tensor). Fix: fold causality into the mask, or pass "
            "is_causal=True and no attn_mask."
        )
    kind = classify_mask(mask, node, seq_len)
    val = mask.meta.get("example_value")
    if isinstance(val, torch.Tensor) and val.requires_grad and not _learned_parts_lifted(kind):
        raise CPRewriteError(
            f"cp_compile: the attn_mask of scaled_dot_product_attention at {source_line(node)} requires grad "
            "(a learned attention bias) and is not a rule of positions over whole learned tables (T5's "
            "bucketed relative bias, learned ALiBi slopes); the ring op treats other masks as constants and "
            "would drop its gradient. Fix: detach the bias if it is not trained, build it from positions and "
            "parameters only (not from activations), or run this model without context parallelism."
        )
    ctx.masks[node] = kind


def _learned_parts_lifted(kind) -> bool:
    """Whether every part of a mask that requires grad became a score rule (its learned tables the ring
    op's score buffers, their gradient from its backward): no explicit term or document ids need one."""
    parts = list(kind.explicit) + list(kind.explicit_adds) + ([kind.doc_ids] if kind.doc_ids is not None else [])
    grads = [isinstance(v := p.meta.get("example_value"), torch.Tensor) and v.requires_grad for p in parts]
    return not any(grads) and any(r.learned for r in kind.scores)


def find_attention(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Fill ``ctx.attention`` and ``ctx.seq_len``; raise if there is nothing to parallelise."""
    ctx.attention = [n for n in gm.graph.nodes if is_sdpa(n)]
    lens = {_check_flex(gm, n, ctx) if is_flex(n) else _check_supported(n, ctx) for n in ctx.attention}
    if len(lens) > 1:
        raise CPRewriteError(
            f"cp_compile: attention calls use different sequence lengths {sorted(lens)} in one graph. "
            "Fix: compile models whose attention layers share one sequence."
        )
    if lens:
        ctx.seq_len = lens.pop()
    if ctx.attention and ctx.options.inputs == "local" and ctx.seq_sym is None:
        raise CPRewriteError(
            f"cp_compile: inputs='local' needs the sequence length symbolic, but the traced graph has the static "
            f"local length {ctx.seq_len}: it only knows the local length, and which of its constants mean 'the "
            "whole sequence' cannot be guessed. Either the model was compiled without dynamic=True, or Dynamo "
            "specialized the length anyway: under dynamic=True a size equal to another input size shares its "
            f"symbol (duck sizing), so a local length of {ctx.seq_len} equal to a size fixed by the weights (a "
            "head dim, a RoPE table's width) becomes that constant. Fix: torch.compile(..., dynamic=True) with "
            f"inputs='local', on sequences whose local length differs from the model's other sizes (not "
            f"{ctx.seq_len}), or pass full batches (inputs='full')."
        )
    log.info("cp_compile: %d attention node(s), sequence length %d", len(ctx.attention), ctx.seq_len)
    return gm
