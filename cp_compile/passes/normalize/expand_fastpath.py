"""Open the eval-mode fast paths of the ``nn.Transformer*`` layers into plain ops.

In eval mode with autograd off (``torch.no_grad()`` / ``torch.inference_mode()``),
``nn.TransformerEncoderLayer(batch_first=True)`` skips its Python code for one fused op,
and Dynamo (torch 2.13) records it as one node, ``torch._transformer_encoder_layer_fwd``:
without this pass every rank runs that layer on the whole sequence. ``nn.MultiheadAttention``
never takes its own fast path under Dynamo (torch folds ``_is_make_fx_tracing()`` to True
while tracing, so the module records ``F.multi_head_attention_forward``, which
:mod:`.expand_mha` opens); ``torch._native_multi_head_attention`` reaches a graph only when
called directly, and is opened here too.

Before (batch first; ``merge_masks`` turned an (S, S) mask into (B, H, S, S), mask_type 2)::

    m4 = m.view(1, 1, S, S).expand(B, H, -1, -1)                                 # (B, H, S, S)
    y = torch._transformer_encoder_layer_fwd(x, E, H, w_qkv, b_qkv, w_o, b_o, use_gelu, norm_first,
            eps, ln1_w, ln1_b, ln2_w, ln2_b, w_1, b_1, w_2, b_2, m4, 2)          # (B, S, E)

After (``norm_first=False``; with ``norm_first=True`` each block's input is normed instead)::

    q, k, v = F.linear(x, w_qkv, b_qkv).chunk(3, -1)                              # (B, S, E) each
    q = q.view(B, -1, H, E // H).transpose(1, 2)                                  # (B, H, S, hd); k, v alike
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=c)      # (B, H, S, hd)
    a = F.linear(o.transpose(1, 2).flatten(-2), w_o, b_o)                         # (B, S, E)
    h = F.layer_norm(a + x, (E,), ln1_w, ln1_b, eps)                              # (B, S, E)
    f = F.linear(F.relu(F.linear(h, w_1, b_1)), w_2, b_2)                         # F.gelu if use_gelu
    y = F.layer_norm(f + h, (E,), ln2_w, ln2_b, eps)                              # (B, S, E)

Masks mean what the native op makes of them: a float mask is read as a boolean, masked
where nonzero, so ``keep = mask.logical_not()`` (exact for 0 / -inf masks and for any
other float). ``mask_type`` 0 is an (S, S) mask, 1 a (B, S) key-padding mask (kept as
``keep[:, None, None, :]``), 2 a (B, H, S, S) mask, whose ``view(1, 1, S, S).expand(B, H, ..)``
of an (S, S) mask is undone (SDPA broadcasts it). The fast path drops the layer's
``is_causal=True`` hint; the mask ``nn.Transformer.generate_square_subsequent_mask`` builds,
``triu(full((S, S), -inf), diagonal=1)``, is recognised instead and becomes
``is_causal=True`` with no mask (the ring op then needs no tensor); with a key-padding mask
added to it (mask_type 2), ``(kv <= q) & keep_pad[:, None, None, :]``, which :mod:`.masks`
splits into the causal flag and a (B, 1, 1, S) explicit term. Mask-building nodes nothing
reads any more are erased.

Refused with a :class:`CPRewriteError` naming the op, its source line and the fix: the
attention weights of ``_native_multi_head_attention`` used, cross-attention (query, key,
value not one value), a mask without a ``mask_type`` its shape fits, sizes or flags that
are not constants, input not (B, S, E). Differs from the native op: rows whose every key
is masked (native: NaN, SDPA: zeros). Never seen here: a nested-tensor input
(``nn.TransformerEncoder(enable_nested_tensor=True)`` with a padding mask): under
torch.compile its ``mask_check`` skips the conversion, and with ``mask_check=False``
Dynamo cannot trace ``torch._nested_tensor_from_mask`` and runs the layers eagerly (and
:func:`.nested.refuse_nested_tensors` refuses any nested value first).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..context import CPRewriteError, RewriteContext, fake_value, source_line
from ..op_vocab import arguments
from ..propagate.emitter import erase_unused
from .expand_mha import weights_used
from .fake_emit import FakeEmitter, finish_expansion

ENCODER_LAYER = torch._transformer_encoder_layer_fwd
NATIVE_MHA = torch._native_multi_head_attention
_SCHEMAS = {ENCODER_LAYER: torch.ops.aten._transformer_encoder_layer_fwd.default._schema,
            NATIVE_MHA: torch.ops.aten._native_multi_head_attention.default._schema}
_WHAT = {ENCODER_LAYER: "nn.TransformerEncoderLayer's eval-mode fast path (torch._transformer_encoder_layer_fwd)",
         NATIVE_MHA: "torch._native_multi_head_attention (nn.MultiheadAttention's fast path)"}
_MASK_DIMS = {0: 2, 1: 2, 2: 4}  # mask_type -> mask dims: (S, S), (B, S), (B, H, S, S)


def expand_fastpath(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace each fast-path node by its plain ops (or raise); return how many were."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SCHEMAS:
            continue
        a = _fastpath_args(node)
        why = _refusal(node, a)
        if why is not None:
            raise CPRewriteError(f"cp_compile: {_WHAT[node.target]} at {source_line(node)} cannot become ring "
                                 f"attention: {why}")
        mask = a["mask"]
        if node.target is ENCODER_LAYER:
            _expand_layer(gm.graph, node, a)
        else:
            _expand_mha(gm.graph, node, a)
        erase_unused(gm.graph, [mask])
        count += 1
    return finish_expansion(gm, count, "eval-mode fast-path attention op(s)")


def _fastpath_args(node: fx.Node) -> Dict[str, Any]:
    """The node's arguments by their ATen schema names, defaults filled in."""
    schema = _SCHEMAS[node.target]
    a = {arg.name: arg.default_value if arg.has_default_value() else None for arg in schema.arguments}
    a.update(arguments(node, [arg.name for arg in schema.arguments]))
    a["heads"] = a.get("num_heads", a.get("num_head"))  # the two ops spell it differently
    a["x"] = a.get("src", a.get("query"))
    return a


def _refusal(node: fx.Node, a: Dict[str, Any]) -> Optional[str]:
    """Why this node cannot be opened exactly (with the fix), or None."""
    if node.target is NATIVE_MHA:
        if weights_used(node):
            return ("its attention weights are used (need_weights=True returns the L x S weights, which ring "
                    "attention never forms). Fix: pass need_weights=False, or drop the use of the weights")
        if not (a["query"] is a["key"] is a["value"]):
            return ("it is cross-attention (query, key and value differ); context parallelism splits one sequence "
                    "for self-attention. Fix: keep the cross-attention out of the compiled CP region")
    x = fake_value(a["x"])
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "its input is not batched (B, S, E). Fix: pass a batch dim"
    flags = ("use_gelu", "norm_first") if node.target is ENCODER_LAYER else ()  # eps may be a graph value
    for name in ("embed_dim", "heads", *flags):
        if not isinstance(a[name], int):  # bool is an int
            return f"{name} is not a constant. Fix: build the module with constant sizes and flags"
    mask = a["mask"]
    if mask is not None:
        dims = fake_value(mask).dim() if isinstance(mask, fx.Node) else None
        if _MASK_DIMS.get(a["mask_type"]) != dims:
            return (f"its mask ({dims}-D) does not fit mask_type={a['mask_type']} (0: (S, S), 1: (B, S), "
                    "2: (B, H, S, S)). Fix: call the module, which sets mask_type, or pass a matching mask_type")
    return None


def _attention(em: FakeEmitter, x: fx.Node, a: Dict[str, Any]) -> fx.Node:
    """Self-attention of ``x`` (B, S, E) with in/out projections, as the native op computes it: (B, S, E)."""
    embed, heads = a["embed_dim"], a["heads"]
    batch = em.size(x, 0)
    parts = em.method("chunk", em.fn(F.linear, x, a["qkv_weight"], a["qkv_bias"]), 3, -1)  # 3 x (B, S, E)
    q, k, v = (
        em.method("transpose", em.method("view", em.fn(operator.getitem, parts, i), batch, -1, heads,
                                         embed // heads), 1, 2)  # (B, S, E) -> (B, H, S, hd)
        for i in range(3)
    )
    keep, causal = _mask(em, a["mask"], a["mask_type"], x)
    out = em.fn(F.scaled_dot_product_attention, q, k, v, attn_mask=keep, dropout_p=0.0, is_causal=causal)
    out = em.method("flatten", em.method("transpose", out, 1, 2), -2)  # (B, H, S, hd) -> (B, S, E)
    return em.fn(F.linear, out, a["proj_weight"], a["proj_bias"])  # (B, S, E)


def _mask(em: FakeEmitter, mask: Optional[fx.Node], mask_type: Optional[int], x: fx.Node
          ) -> Tuple[Optional[fx.Node], bool]:
    """SDPA's (attn_mask, is_causal) for the native op's (mask, mask_type), as a boolean keep-mask."""
    if mask is None:
        return None, False
    if mask_type == 1:
        return _key_keep(em, mask), False
    seq = fake_value(x).shape[1]
    if mask_type == 2:
        attn, pad = _merged_parts(mask)
        if pad is not None and attn is not None and _causal_fill(attn, seq) == float("-inf"):
            # -inf + anything is never 0: merged == 0 iff causal and the key is kept
            return em.fn(operator.and_, _causal_keep(em, x), _key_keep(em, pad)), False  # (B, 1, S, S)
        mask = attn if pad is None and attn is not None else mask  # (S, S), else (B, H, S, S)
    if fake_value(mask).dim() == 2 and _causal_fill(mask, seq) is not None:
        return None, True
    return em.method("logical_not", mask), False  # native: mask.to(bool) is masked, so nonzero floats mask


def _key_keep(em: FakeEmitter, pad: fx.Node) -> fx.Node:
    """The keys to keep, (B, 1, 1, S), of a key-padding mask (B, S) (nonzero / True: ignore that key)."""
    keep = em.method("logical_not", pad)  # (B, S) bool
    return em.fn(operator.getitem, keep, (slice(None), None, None, slice(None)))  # (B, 1, 1, S)


def _causal_keep(em: FakeEmitter, x: fx.Node) -> fx.Node:
    """``kv <= q`` over positions (S, S): the causal mask in the form :mod:`.masks` reads as a band."""
    pos = em.fn(torch.arange, em.size(x, 1), device=fake_value(x).device)  # (S,)
    kv = em.fn(operator.getitem, pos, (None, slice(None)))  # (1, S)
    q = em.fn(operator.getitem, pos, (slice(None), None))  # (S, 1)
    return em.fn(operator.le, kv, q)  # (S, S) bool


def _is_method(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _expanded_source(node: Any, dims: Tuple[int, int]) -> Optional[fx.Node]:
    """``m`` (2-D) of ``m.view(...).expand(...)`` whose view has size 1 at ``dims``, else None."""
    if not (_is_method(node, "expand") and _is_method(node.args[0], "view")):
        return None
    view, source = node.args[0], node.args[0].args[0]
    shape = fake_value(view).shape
    ok = isinstance(source, fx.Node) and fake_value(source).dim() == 2 and len(shape) == 4
    return source if ok and all(statically_known_true(shape[d] == 1) for d in dims) else None


def _merged_parts(mask: fx.Node) -> Tuple[Optional[fx.Node], Optional[fx.Node]]:
    """(m (S, S), kpm (B, S)) of merge_masks's (B, H, S, S) ``m.view(1, 1, S, S).expand(B, H, -1, -1)``
    [``+ kpm.view(B, 1, 1, S).expand(-1, H, -1, -1)``]; None for a part not there or not so built."""
    if mask.op == "call_function" and mask.target is operator.add and len(mask.args) == 2:
        attn, pad = _expanded_source(mask.args[0], (0, 1)), _expanded_source(mask.args[1], (1, 2))
        return (attn, pad) if attn is not None and pad is not None else (None, None)
    return _expanded_source(mask, (0, 1)), None


def _causal_fill(mask: fx.Node, seq: Any) -> Optional[float]:
    """c when ``mask`` is ``torch.triu(torch.full((S, S), c), diagonal=1)``, c != 0, S = ``seq``
    (``generate_square_subsequent_mask``: masked exactly above the diagonal, i.e. causal); else None."""
    if not (mask.op == "call_function" and mask.target is torch.triu):
        return None
    full = mask.args[0]
    diagonal = arguments(mask, ("input", "diagonal")).get("diagonal", 0)
    if diagonal != 1 or not (isinstance(full, fx.Node) and full.op == "call_function" and full.target is torch.full):
        return None
    fill = arguments(full, ("size", "fill_value")).get("fill_value")
    rows, cols = fake_value(mask).shape
    square = statically_known_true(rows == seq) and statically_known_true(cols == seq)
    return fill if square and isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill != 0 else None


def _feed_forward(em: FakeEmitter, x: fx.Node, a: Dict[str, Any]) -> fx.Node:
    """linear2(act(linear1(x))), act the exact GELU when ``use_gelu`` else ReLU (as the native op): (B, S, E)."""
    hidden = em.fn(F.linear, x, a["ffn_weight_1"], a["ffn_bias_1"])  # (B, S, F)
    hidden = em.fn(F.gelu if a["use_gelu"] else F.relu, hidden)
    return em.fn(F.linear, hidden, a["ffn_weight_2"], a["ffn_bias_2"])  # (B, S, E)


def _expand_layer(graph: fx.Graph, node: fx.Node, a: Dict[str, Any]) -> None:
    """``_transformer_encoder_layer_fwd`` -> norms, self-attention, feed-forward and residuals."""
    em = FakeEmitter(graph, node, a["src"])
    src, first = a["src"], a["norm_first"]

    def norm(t: fx.Node, i: int) -> fx.Node:  # (B, S, E)
        return em.fn(F.layer_norm, t, (a["embed_dim"],), a[f"norm_weight_{i}"], a[f"norm_bias_{i}"], a["eps"])

    x = em.fn(operator.add, _attention(em, norm(src, 1) if first else src, a), src)  # (B, S, E)
    if not first:
        x = norm(x, 1)
    x = em.fn(operator.add, _feed_forward(em, norm(x, 2) if first else x, a), x)  # (B, S, E)
    if not first:
        x = norm(x, 2)
    node.replace_all_uses_with(x)
    graph.erase_node(node)


def _expand_mha(graph: fx.Graph, node: fx.Node, a: Dict[str, Any]) -> None:
    """``_native_multi_head_attention`` -> its output 0 from the plain ops; output 1 (unused) dropped."""
    em = FakeEmitter(graph, node, a["query"])
    out = _attention(em, a["query"], a)  # (B, S, E)
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)
