"""The layout rules: one table from op to rule, for ops with a Sharded input (the rules
themselves live in the modules named in the first column).

| op class | ops | Sharded(d) in -> out |
|---|---|---|
| pointwise (broadcasting; pointwise.py) | + - * / neg pow square polar, rsqrt/exp/..., silu/gelu/relu, to/float/type_as, masked_fill, where | Sharded(aligned d); Global operands with size S there are indexed by position |
| per-token (pointwise.py) | linear, embedding, layer_norm, rms_norm (F. and torch.), softmax/log_softmax (not over d) | Sharded(d) |
| matmul (pointwise.py) | matmul / @ / bmm: tokens in the left side's rows, or in the right side's columns (RoPE as inv_freq @ position_ids), not contracted | Sharded(d) |
| einsum (einsum.py) | any equation keeping the sequence letter in the output; Global operands with it indexed | Sharded(letter's output dim) |
| complex views (complex.py) | view_as_complex / view_as_real (drop / add the trailing (re, im) dim) | Sharded(d) |
| addmm (pointwise.py) | addmm(bias, x, W) with tokens in x's rows (HF GPT-2 Conv1D) | Sharded(0) |
| views (views.py) | view/reshape (baked length rewritten to the local one), flatten, (un)squeeze, transpose/permute/movedim, expand, contiguous | Sharded(where d moves) |
| split/join (views.py) | chunk/split/unbind/cat/stack/repeat_interleave not along d; empty cat operands (HF's training KV cache) dropped | Sharded(d) |
| getitem (getitem.py) | ``...`` expanded; a slice covering all of d (``[:, 0:]``); one position ``x[:, i]`` (cls / last-token pooling) | Sharded(d moved); one position: picked on its rank, all-reduce -> Global |
| size (reductions.py) | ``x.size()`` / ``x.size(d)`` (dynamic shapes) | Global: the global sizes, S along d |
| reductions (reductions.py) | sum/mean over d; histc (padding rows moved out of its range) | all-reduce -> Global (mean: / global count) |
| selections (routing.py, routing_rows.py) | torch.where(mask) / nonzero of a Sharded mask, sort of 1-D Sharded expert ids; x[top_x], index_select, index_add_ / x[top_x] += / index_put_ / scatter_add_ by those indices; per-row ops, histc / grouped_mm on the selected rows; the inverse permutation | Local (this rank's tokens, selected by data); index_add_ / rows[inv] back -> Sharded |
| attention (attention.py) | scaled_dot_product_attention on Sharded or whole q/k/v (whole: indexed by position) | ring_attention -> Sharded |
| flex attention (flex.py) | torch.ops.higher_order.flex_attention: mask_mod / score_mod at global positions, their buffers whole | ring_attention(mods=...) -> (Sharded, Sharded, -) |
| losses (attention.py) | cross_entropy / nll_loss (mean: / global valid count), mse_loss/l1_loss | all-reduce -> Global |
| custom autograd.Function (autograd_fn.py) | higher_order.autograd_function_apply whose forward and backward bodies are per-token by their ATen decompositions | Sharded(d) per output |
| torch.vmap (vmap.py) | functorch's _add_batch_dim / _remove_batch_dim of an inlined vmap (not over the sequence) | Sharded(d moved by the batch dim) |
| fresh buffers (fill.py) | x.new_empty / new_zeros / new_ones / new_full shaped like Sharded x; dst.copy_(src) into a Sharded dst | Sharded(d), at the local length; copy_ elementwise in place |
| anything else | per-token by its ATen decomposition (passes/oracle.py: erf, lerp, normalize(-1), ...) | as DTensor propagates |
| what the oracle refuses | (token mixing: slices along d, roll, cumsum, conv, ...) | fallback: gather to Global, warn |
"""  # noqa: E501 (a Markdown table: its rows cannot wrap)

from __future__ import annotations

import operator
from typing import Any, Dict

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..emitter import Emitter
from ..oracle import decide
from .attention import attention_rule, loss_rules
from .autograd_fn import autograd_function_rules
from .common import Rule, _key, _name
from .complex import complex_rules
from .einsum import einsum_rules
from .fill import fill_rules
from .flex import flex_rules
from .getitem import getitem
from .pointwise import POINTWISE_FUNCS, POINTWISE_METHODS, addmm, matmul, per_token, pointwise
from .reductions import histc, reduction, size
from .routing import _SELECT, _SORT, involves_local, local_rule, select, sort, where
from .views import along_dim, concat, expand, permute, shape_only, view
from .vmap import vmap_rules


def _table() -> Dict[Any, Rule]:
    t: Dict[Any, Rule] = {f: pointwise for f in POINTWISE_FUNCS}
    t.update({("method", m): pointwise for m in POINTWISE_METHODS})
    norms = [getattr(m, "rms_norm") for m in (F, torch) if hasattr(m, "rms_norm")]  # nn.RMSNorm: torch.rms_norm
    for f in (F.linear, torch._C._nn.linear, F.embedding, F.layer_norm, F.softmax, F.log_softmax, *norms):
        t[f] = per_token
    t.update({("method", "softmax"): per_token, ("method", "log_softmax"): per_token})
    t.update({operator.matmul: matmul, torch.matmul: matmul, torch.bmm: matmul,
              ("method", "matmul"): matmul, ("method", "bmm"): matmul})
    t.update({torch.addmm: addmm, ("method", "addmm"): addmm})
    t.update({("method", "view"): view, ("method", "reshape"): view, torch.reshape: view})
    for m in ("flatten", "squeeze", "unsqueeze", "contiguous"):
        t[("method", m)] = shape_only
    t.update({torch.flatten: shape_only, torch.squeeze: shape_only, torch.unsqueeze: shape_only})
    for m in ("transpose", "swapaxes", "swapdims", "permute", "movedim", "t"):
        t[("method", m)] = permute
    t.update({torch.transpose: permute, torch.permute: permute, torch.movedim: permute})
    t[("method", "expand")] = expand
    for m in ("chunk", "split", "unbind", "repeat_interleave"):
        t[("method", m)] = along_dim
    t.update({torch.chunk: along_dim, torch.split: along_dim, torch.unbind: along_dim})
    t.update({torch.cat: concat, torch.concat: concat, torch.stack: concat})
    t[operator.getitem] = getitem
    t[("method", "size")] = size
    for m in ("sum", "mean"):
        t[("method", m)] = reduction
    t.update({torch.sum: reduction, torch.mean: reduction, torch.histc: histc, ("method", "histc"): histc})
    t.update(attention_rule())
    t.update(loss_rules())
    t.update(complex_rules())
    t.update(einsum_rules())
    t.update(flex_rules())
    t.update(autograd_function_rules())
    t.update(vmap_rules())
    t.update(fill_rules())
    t.update({k: select for k in _SELECT})
    t.update({k: sort for k in _SORT})
    t[torch.where] = where  # one argument: the indices of a selection (routing.py)
    return t


RULES: Dict[Any, Rule] = _table()


def apply_rule(em: Emitter, node: fx.Node):
    """Layout and new value of ``node``, which has at least one Sharded or Local input."""
    if involves_local(em, node):
        return local_rule(em, node)
    rule = RULES.get(_key(node))
    if rule is None:
        decided = decide(em, node)  # no hand rule: ask the op's ATen decomposition before gathering
        if decided is not None:
            return decided
        return em.fallback(node, f"{_name(node)} is not known to be per-token")
    return rule(em, node)
