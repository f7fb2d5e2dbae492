"""Rules for attention: scaled_dot_product_attention -> ring attention; the inputs a mask reads whole."""

from __future__ import annotations

import math
import operator
from typing import Any, Dict, Tuple

import torch.fx as fx
import torch.nn.functional as F

from ....ring.call_spec import RING_FWD, emitted_call
from ...context import CPRewriteError, global_shape, log, source_line
from ...node_facts import set_facts
from ...op_vocab import RESHAPES, SDPA_PARAMS, SDPA_TARGETS, arguments
from ..placements import GLOBAL, Sharded
from ...analyze.masks.documents import doc_ids_value, whole
from ...analyze.masks.lift import ring_mods
from ...analyze.masks.rows import explicit_mask
from .registry import register_rule


def _kv_source(em, old: fx.Node):
    """The un-repeated (B, H_kv, S, D) value behind a GQA head repeat feeding attention, or None.

    Recognised: ``k.repeat_interleave(g, dim=1)`` and Hugging Face's
    ``k[:, :, None].expand(B, H_kv, g, S, D).reshape(B, H_kv * g, S, D)``.
    """
    if old.op != "call_method":
        return None
    if old.target == "repeat_interleave":
        dim = arguments(old, ("input", "repeats", "dim")).get("dim")
        return old.args[0] if dim in (1, -3) else None
    if old.target not in RESHAPES:
        return None
    exp = old.args[0]
    if not (isinstance(exp, fx.Node) and exp.op == "call_method" and exp.target == "expand"):
        return None
    ins = exp.args[0]
    src = ins.args[0] if isinstance(ins, fx.Node) and ins.target in (operator.getitem, "unsqueeze") else None
    shapes = [global_shape(n) if isinstance(n, fx.Node) else None for n in (src, ins, exp, old)]
    if None in shapes or len(shapes[0]) != 4:
        return None
    (b, hkv, s, d), expanded = shapes[0], shapes[2]
    if tuple(shapes[1]) != (b, hkv, 1, s, d) or tuple(expanded[:2]) != (b, hkv) or tuple(expanded[3:]) != (s, d):
        return None
    return src


def _unrepeated_kv(em, old: fx.Node) -> fx.Node:
    """Ship the H_kv heads around the ring, not their repeated copies."""
    src = _kv_source(em, old)
    if src is not None and isinstance(em.layout(src), Sharded) and em.layout(src).dim == 2:
        return src
    return old


def _as_seq_sharded(em, old: fx.Node, node: fx.Node) -> Any:
    lay = em.layout(old)
    if isinstance(lay, Sharded):
        if lay.dim != 2 or lay.inner != 1:
            raise CPRewriteError(f"cp_compile: attention input {old.name} at {source_line(node)} is sharded along "
                                 f"dim {lay.dim}, expected (B, H, S, D) with the sequence at dim 2.")
        return em.env[old]
    if em.ctx.options.inputs == "local":  # a whole value here has the local length: nothing to index it by
        raise CPRewriteError(
            f"cp_compile: attention input {old.name} at {source_line(node)} does not come from a sequence input, "
            "and with inputs='local' the graph cannot tell which of its rows are this rank's. Fix: "
            "inputs='full' (every rank passes the whole batch), or seq_inputs={name: dim} naming the inputs "
            "that carry the sequence.")
    return em.to_sharded(old, 2)  # every rank holds it whole: take this rank's rows, no communication


@register_rule(*SDPA_TARGETS)
def sdpa(em, node: fx.Node):
    """scaled_dot_product_attention -> the ring op on this rank's rows of q, k, v."""
    a = arguments(node, SDPA_PARAMS)
    q, k, v = a["query"], _unrepeated_kv(em, a["key"]), _unrepeated_kv(em, a["value"])
    # A mask is split into causal / window flags, document ids and explicit terms (passes/masks/);
    # the ring op gets the flags, the whole ids (masks/documents.py) and this rank's rows of the terms
    # (masks/rows.py), and rewrite.py erases the mask's O(S^2) construction, now unused.
    kind = em.ctx.masks.get(node)
    causal = kind.causal if kind is not None else bool(a["is_causal"])
    masks = {"window": kind.window} if kind is not None and kind.window > 0 else {}
    if kind is not None and (kind.explicit or kind.explicit_adds):
        masks["attn_mask"] = explicit_mask(em, kind.explicit, node, kind.explicit_adds)
    if kind is not None and kind.doc_ids is not None:
        masks["doc_ids"] = doc_ids_value(em, kind.doc_ids, node)  # (B|1, S) whole, on every rank
    score_fn = node.kwargs.get("score_fn")  # f(scores) before the mask terms (passes/score_fn.py)
    score_fn = getattr(em.gm, score_fn.target) if isinstance(score_fn, fx.Node) else None
    if kind is not None or score_fn is not None:  # rules of positions: mask_mod / score_mod, O(S) leaves (lift.py)
        masks.update(ring_mods(em, kind.rules if kind else (), kind.scores if kind else (), node, score_fn))
    scale = a["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(global_shape(q)[-1])
    hq, hk, hv = global_shape(q)[1], global_shape(k)[1], global_shape(v)[1]
    if hk != hv or hq % hk:
        raise CPRewriteError(f"cp_compile: attention at {source_line(node)} has q/k/v heads {hq}/{hk}/{hv}; "
                             "need H % H_kv == 0 and equal k/v heads.")
    if em.index.table is not None:  # load_balance="documents": this call's layout (passes/doc_table.py)
        masks["positions"] = em.index.table
    qkv, dv = _equal_head_dims(em, *(_as_seq_sharded(em, x, node) for x in (q, k, v)), global_shape(q)[-1],
                               global_shape(v)[-1])
    out = emit_ring(em, qkv, (hq, hk), causal, float(scale), masks)
    out = em.call(operator.getitem, out, 0)  # (B, H, c, max(D_qk, D_v))
    return (out if dv is None else em.call(operator.getitem, out, (Ellipsis, slice(None, dv)))), Sharded(2)


def emit_ring(em, qkv: Tuple[fx.Node, fx.Node, fx.Node], heads: Tuple[int, int], causal: bool, scale: float,
              masks: Dict[str, Any]) -> fx.Node:
    """The ring op on this rank's (q, k, v), ``masks`` its masking keyword arguments; the call's
    description (:class:`cp_compile.ring.call_spec.RingCall`, ``heads`` = (H_q, H_kv)) recorded on it."""
    ctx = em.ctx
    opts = ctx.options
    flags = {"causal": causal, "scale": scale, "group_name": ctx.group.name,  # in the schema's order
             "load_balance": opts.load_balance, "rotate": opts.rotate, "kernel": opts.kernel,
             "valid_len": em.index.valid_len()}
    ring = em.call(RING_FWD, *qkv, *flags.values(), **masks)  # -> (out (B, H, c, D), lse (B, H, c))
    set_facts(ring, ring_call=emitted_call(heads, **flags, **masks))
    return ring


def _equal_head_dims(em, q: fx.Node, k: fx.Node, v: fx.Node, d_qk: int, d_v: int):
    """(q, k, v) zero-padded to one head dim, and the D_v to slice the output back to (None if equal).
    The ring moves K and V as one block, so their head dims must agree (DeepSeek's MLA has
    D_qk = 192, D_v = 128). Zero columns of V give zero output columns; zero columns of q and k
    leave every q·k unchanged (the scale is already fixed from the original D_qk)."""
    if d_qk == d_v:
        return (q, k, v), None
    d = max(d_qk, d_v)
    pad = lambda x, n: x if n == d else em.call(F.pad, x, (0, d - n))  # noqa: E731
    return (pad(q, d_qk), pad(k, d_qk), pad(v, d_v)), (d_v if d_v < d else None)


@register_rule(whole)
def whole_rule(em: Any, node: fx.Node):
    """The layout rule of :func:`..masks.documents.whole` on a sharded input: the input whole, on every rank
    (a mask's ingredients, such as document ids, are computed from whole inputs)."""
    src = node.args[0]
    lay = em.layout(src)
    if not isinstance(lay, Sharded):
        return em.env[src], GLOBAL
    if em.ctx.options.inputs == "full" and src.op == "placeholder":  # every rank was passed the whole input
        new = next(n for n in em.graph.nodes if n.op == "placeholder" and n.target == src.target)
        return new, GLOBAL
    log.info("cp_compile: the attention mask at %s reads the input %s whole: all-gathered (%s integers)",
             source_line(node), src.name, em.ctx.seq_len)
    return em.to_global(src), GLOBAL

