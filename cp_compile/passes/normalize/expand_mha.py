"""Open ``F.multi_head_attention_forward`` into plain ops ending in SDPA.

Dynamo keeps ``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` and the
``nn.Transformer*`` layers call) as one opaque node, so without this pass a model built
from them has no ``scaled_dot_product_attention`` and gets no context parallelism. The
node is replaced by the ops torch itself runs on its ``need_weights=False`` path, so the
later passes (find_attention, masks, the layout rewrite) see an ordinary transformer.

Before (inputs sequence-first (L, N, E); ``batch_first=True`` modules transpose first)::

    out = F.multi_head_attention_forward(x, x, x, E, H, w_in, b_in, None, None, False, 0.0,
                                         w_out, b_out, key_padding_mask=kpm, attn_mask=m, ...)
    y = out[0]                                                      # (L, N, E)

After::

    q, k, v = F.linear(x, w_in, b_in).chunk(3, -1)                  # (L, N, E) each
    q = q.view(-1, N, H, E // H).permute(1, 2, 0, 3)                # (N, H, L, hd), k, v alike
    mask = m.to(dtype).masked_fill(m, -inf) if m is bool else m     # (L, S) or (N*H, L, S) -> (N, H, L, S)
    mask = mask + kpm_float[:, None, None, :]                       # (N, 1|H, L, S), if kpm is given
    o = F.scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal)  # (N, H, L, hd)
    y = F.linear(o.permute(2, 0, 1, 3).flatten(-2), w_out, b_out)  # (L, N, E)

Masks follow torch exactly: a bool mask becomes additive (-inf where True, as
``F._canonical_mask``); ``is_causal`` with no key-padding mask and ``need_weights=False``
drops ``attn_mask`` and passes ``is_causal=True``; a key-padding mask is added to it (and
turns ``is_causal`` off). The views use -1 for the sequence length, so nothing is baked
in that the layout rewrite would have to change.

Left unexpanded, with a WARNING naming the source line and the fix (a CPRewriteError
under ``strict=True``): the attention weights used (``need_weights=True`` and the
(N, L, S) weights read), cross-attention (query, key, value not one value; the
``multihead_attn`` of an ``nn.TransformerDecoderLayer`` is named as such, with the
decoder-only fix: ``nn.TransformerEncoderLayer`` with a causal mask), ``bias_k`` /
``bias_v``, ``add_zero_attn``, ``static_k`` / ``static_v``, dropout in training,
unbatched (2-D) inputs. :mod:`.unsplit` then reports the graph if it has no other
attention. The eval-mode fast paths (``torch._transformer_encoder_layer_fwd``,
``torch._native_multi_head_attention``) are other ops: :mod:`.expand_fastpath` opens them.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..context import CPRewriteError, RewriteContext, fake_value, log, source_line
from ..op_vocab import arguments
from ...warn_once import warn_once
from .fake_emit import FakeEmitter, finish_expansion

MHA = F.multi_head_attention_forward


def expand_mha(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace each expandable ``multi_head_attention_forward`` node; return how many were."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not MHA:
            continue
        a = arguments(node)
        why = _refusal(node, a)
        if why is not None:
            _refuse(node, why, ctx)
            continue
        _expand(gm.graph, node, a)
        count += 1
    return finish_expansion(gm, count, "multi_head_attention_forward call(s)")


def weights_used(node: fx.Node) -> bool:
    """Whether the (N, L, S) attention weights (output 1) are read, or the tuple escapes."""
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            return True
        if user.args[1] == 1 and user.users:
            return True
    return False


def _refusal(node: fx.Node, a: Dict[str, Any]) -> Optional[str]:
    """Why this call cannot become SDPA (with the fix), or None."""
    if weights_used(node):
        return ("its attention weights are used (need_weights=True returns the L x S weights, which ring attention "
                "never forms). Fix: call the module with need_weights=False, or drop the use of the weights")
    if not (a["query"] is a["key"] is a["value"]):
        return _cross_attention(node)
    if a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"]:
        return ("it appends keys (add_bias_kv=True or add_zero_attn=True). Fix: build nn.MultiheadAttention with "
                "add_bias_kv=False, add_zero_attn=False")
    if a["static_k"] is not None or a["static_v"] is not None:
        return "it takes static_k/static_v. Fix: pass no static keys/values"
    dropout = a["dropout_p"]
    if isinstance(dropout, fx.Node) or (a["training"] is not False and dropout != 0.0):
        return (f"it applies attention dropout (dropout_p={dropout}) in training. Fix: set the attention dropout "
                "to 0 (nn.MultiheadAttention(dropout=0.0)) or model.eval()")
    query = fake_value(a["query"])
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        return "its input is not batched (L, N, E). Fix: pass a batch dim"
    if a["is_causal"] and a["attn_mask"] is None:
        return "is_causal=True without attn_mask (torch raises). Fix: pass the causal attn_mask too"
    for name in ("attn_mask", "key_padding_mask", "embed_dim_to_check", "num_heads"):
        if not isinstance(a[name], (fx.Node, type(None), int)):
            return f"{name} is not a tensor or a constant"
    return None


def _cross_attention(node: fx.Node) -> str:
    """Why cross-attention is left whole, naming nn.TransformerDecoderLayer's memory attention."""
    why = ("it is cross-attention (query, key and value differ); context parallelism splits one sequence for "
           "self-attention")
    layer = decoder_layer_path(node)
    if layer is None:
        return why + ". Fix: keep the cross-attention out of the compiled CP region"
    return (f"it is the cross-attention of nn.TransformerDecoderLayer {layer} (multihead_attn: queries from the "
            "target, keys and values from `memory`), which cannot be made context-parallel: ring attention "
            "splits one sequence for self-attention, and memory is another sequence, even when it is the same tensor. "
            "Fix: for a decoder-only model (memory = the sequence itself) build it from nn.TransformerEncoderLayer "
            "with a causal mask (src_mask=nn.Transformer.generate_square_subsequent_mask(S), is_causal=True), whose "
            "self-attention becomes the ring; for an encoder-decoder keep the decoder out of the compiled CP region")


def decoder_layer_path(node: fx.Node) -> Optional[str]:
    """The module path of the nn.TransformerDecoderLayer whose ``multihead_attn`` made ``node``, else None."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    for (outer, cls), (inner, _) in zip(stack, stack[1:]):
        if isinstance(cls, type) and issubclass(cls, torch.nn.TransformerDecoderLayer) \
                and inner == f"{outer}.multihead_attn":
            return outer.replace("L['self']", "model")
    return None


def _refuse(node: fx.Node, why: str, ctx: RewriteContext) -> None:
    msg = (f"cp_compile: nn.MultiheadAttention (multi_head_attention_forward) at {source_line(node)} is left "
           f"whole: {why}")
    if ctx.options.strict:
        raise CPRewriteError(msg + " (strict=True)")
    warn_once(log, "mha left whole", msg, "%s", msg)


def _in_projection(em: FakeEmitter, a: Dict[str, Any]) -> Tuple[fx.Node, fx.Node, fx.Node]:
    """q, k, v (L, N, E) each, as ``_in_projection_packed`` / ``_in_projection`` compute them."""
    x, bias = a["query"], a["in_proj_bias"]
    if not a["use_separate_proj_weight"]:
        proj = em.fn(F.linear, x, a["in_proj_weight"], bias)  # (L, N, 3E)
        parts = em.method("chunk", proj, 3, -1)  # 3 x (L, N, E): torch's unflatten(-1, (3, E)) rows
        return tuple(em.fn(operator.getitem, parts, i) for i in range(3))  # type: ignore[return-value]
    biases = [None] * 3
    if bias is not None:
        chunks = em.method("chunk", bias, 3)  # 3 x (E,)
        biases = [em.fn(operator.getitem, chunks, i) for i in range(3)]
    weights = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
    return tuple(em.fn(F.linear, x, w, b) for w, b in zip(weights, biases))  # type: ignore[return-value]


def _canonical(em: FakeEmitter, mask: Optional[fx.Node], dtype: torch.dtype) -> Optional[fx.Node]:
    """``F._canonical_mask``: a bool mask -> additive, -inf where True (same dtype as q)."""
    if mask is None or fake_value(mask).dtype != torch.bool:
        return mask
    as_float = em.method("to", mask, dtype)  # 1.0 where True, 0.0 elsewhere
    return em.method("masked_fill", as_float, mask, float("-inf"))  # -inf where True, 0.0 elsewhere


def _mask(em: FakeEmitter, a: Dict[str, Any], heads: int) -> Tuple[Optional[fx.Node], bool]:
    """SDPA's (attn_mask, is_causal), merged as multi_head_attention_forward merges them.

    attn_mask (L, S) stays 2-D (SDPA broadcasts it as torch's (1, 1, L, S)); (N*H, L, S)
    becomes (N, H, L, S); key_padding_mask (N, S) is added as (N, 1, 1, S)."""
    dtype = fake_value(a["query"]).dtype
    kpm = _canonical(em, a["key_padding_mask"], dtype)
    is_causal = bool(a["is_causal"])
    if is_causal and kpm is None and not a["need_weights"]:
        mask = None  # torch trusts the hint: causal, the mask itself is not read
    else:
        mask = _canonical(em, a["attn_mask"], dtype)
        if kpm is not None:
            is_causal = False
    if mask is not None and fake_value(mask).dim() == 3:
        mask = em.method("unflatten", mask, 0, (-1, heads))  # (N*H, L, S) -> (N, H, L, S)
    if kpm is not None:
        kpm = em.fn(operator.getitem, kpm, (slice(None), None, None, slice(None)))  # (N, 1, 1, S)
        mask = kpm if mask is None else em.fn(operator.add, mask, kpm)  # (N, 1|H, L, S)
    # torch's need_weights path ignores is_causal when it has a mask; SDPA refuses both
    return mask, is_causal and mask is None


def _expand(graph: fx.Graph, node: fx.Node, a: Dict[str, Any]) -> None:
    """Emit the plain ops before ``node``, reroute ``node[0]``'s users, erase ``node``."""
    em = FakeEmitter(graph, node, node.args[0])
    embed, heads = a["embed_dim_to_check"], a["num_heads"]
    head_dim = embed // heads
    batch = em.size(a["query"], 1)
    q, k, v = (
        em.method("permute", em.method("view", t, -1, batch, heads, head_dim), 1, 2, 0, 3)  # (N, H, L, hd)
        for t in _in_projection(em, a)  # (L, N, E)
    )
    mask, is_causal = _mask(em, a, heads)
    out = em.fn(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal)
    out = em.method("flatten", em.method("permute", out, 2, 0, 1, 3), -2)  # (N, H, L, hd) -> (L, N, E)
    out = em.fn(F.linear, out, a["out_proj_weight"], a["out_proj_bias"])  # (L, N, E)
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)
