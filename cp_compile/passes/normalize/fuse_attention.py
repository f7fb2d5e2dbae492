"""Turn attention written by hand into ``scaled_dot_product_attention``.

Older model code and much research code writes attention out, so the graph has no SDPA
and, before this pass, got no context parallelism. :mod:`.attention_match` recognises the
chain from ``q·kᵀ`` to ``w·v`` in any of its spellings (matmul, bmm, ``@``, einsum, baddbmm
with a bias; scales, biases and masks in any order; views that regroup batch and heads;
softmax in any dtype); here the chain is replaced by one SDPA, so find_attention, the mask
analysis and the ring rewrite see it as usual.

Before (Hugging Face BLOOM; q, v (B·H, S, D), kᵀ (B·H, D, S), alibi (B·H, 1, S))::

    scores = alibi.baddbmm(batch1=q, batch2=kT, beta=1.0, alpha=1 / sqrt(D))    # (B·H, S, S)
    scores = scores.view(B, H, S, S) + causal                                   # float mask (B, 1, S, S)
    w = softmax(scores, dim=-1, dtype=float32).to(q.dtype)
    out = bmm(w.view(B·H, S, S), v)                                             # (B·H, S, D)

After::

    q4, k4, v4 = q.reshape(B, H, S, D), kT.transpose(-2, -1).reshape(B, H, S, D), v.reshape(B, H, S, D)
    mask = alibi.reshape(B, H, 1, S) + causal
    out = sdpa(q4, k4, v4, attn_mask=mask, scale=1 / sqrt(D)).reshape(B·H, S, D)

SDPA runs on the softmax's leading dims ((B, H); 3-D scores get a head dim of 1). Boolean
masks are ANDed (``~m`` for a masked_fill), biases summed with their coefficients and the
booleans folded in as ``where(keep, bias, -inf)``; no scale op means ``scale=1.0`` (SDPA's
default would be 1/√D); a tensor scale per query row multiplies q. A single mask
``masked_fill(triu(ones(S, S), 1).bool(), -inf)`` (or ``tril(ones(S, S)) == 0``, ``~tril``)
is causal: SDPA gets ``is_causal=True`` and no mask, so the ring op needs no tensor. The new
nodes get fake values and the stack trace of the replaced product; the scores, the softmax
and the mask construction that nothing else reads are erased. Under ``torch.autocast`` the
products cast their operands (float32 q and k after RoPE, a bf16 v); the SDPA gets q, k, v cast
to the products' dtype the same way.

Left as written (:mod:`.unsplit` names each one in a WARNING, the reason from the matcher):
the S x S scores or weights used by anything else (returned, regularised, ...); a scale that
is not a number or a per-row tensor; active dropout; a bias that requires grad and is not a rule
of positions over whole learned tables (one computed from activations; T5's learned relative bias and
learned ALiBi slopes are fused: :func:`..analyze.masks.verify.learned_bias_lifts`); q/k/v whose
lengths or batch dims differ (cross-attention); the two products in different dtypes. A
masked_fill with a finite fill (``finfo.min``, -1e9) becomes a boolean mask: identical except
on rows where every key is masked, which a hand-written softmax spreads uniformly and SDPA does not.
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from .attention_match import Match, Operand, Term, is_softmax, match_attention
from .dead_values import dead_branch
from ..op_vocab import ALIASING, arguments, is_ as _is, same as _same, tensor as _tensor, writes_in_place
from ..context import RewriteContext, log, source_line
from .fake_emit import FakeEmitter
from ..node_facts import set_facts
from ..analyze.score_fn import build_score_fn, scaled_dot_product_attention_with_scores




def fuse_attention(gm: fx.GraphModule, ctx: RewriteContext) -> int:
    """Replace each hand-written attention by SDPA; return how many were."""
    count = 0
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or not is_softmax(node):
            continue
        match, why = match_attention(node)
        if match is None:
            if why:
                log.info("cp_compile: softmax at %s is not turned into scaled_dot_product_attention: %s",
                         source_line(node), why)
            continue
        if _replace(gm.graph, match):
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
        log.info("cp_compile: %d hand-written attention(s) turned into scaled_dot_product_attention", count)
    return count


# -- causal masks built with triu / tril ------------------------------------------------------
def _region(node: Any, seq: Any, dead: List[fx.Node]) -> Optional[Tuple[str, int]]:
    """Where a 0/1 mask of shape (1, .., 1, S, S) is true, as ("ge", d): kv - q >= d, or
    ("le", d): kv - q <= d; None when it is not built from triu / tril of ones."""
    val = _tensor(node)
    if val is None or val.dim() < 2 or not all(_same(d, 1) for d in val.shape[:-2]) \
            or not (_same(val.shape[-1], seq) and _same(val.shape[-2], seq)):
        return None
    dead.append(node)
    if _is(node, {"bool", "to", "contiguous", "float", "int", "long", "unsqueeze", "view", "reshape"}) \
            or (_is(node, {operator.getitem}) and _trivial_index(node.args[1])):
        return _region(node.args[0], seq, dead)
    if _is(node, {torch.triu, torch.tril, "triu", "tril"}):
        ones, d = node.args[0], arguments(node, ("input", "diagonal")).get("diagonal", 0)
        if not isinstance(d, int) or not _is(ones, {torch.ones, "new_ones"}) or _region_of_ones(ones, seq) is None:
            return None
        dead.append(ones)
        upper = node.target in (torch.triu, "triu")
        return ("ge", d) if upper else ("le", d)
    inner: Optional[Tuple[str, int]] = None
    if _is(node, {operator.invert, torch.logical_not, "logical_not", "__invert__"}):
        inner = _region(node.args[0], seq, dead)
    elif _is(node, {operator.eq, torch.eq, "eq"}) and node.args[1] == 0 and not isinstance(node.args[1], bool):
        inner = _region(node.args[0], seq, dead)
    if inner is None:
        return None
    op, d = inner
    return ("le", d - 1) if op == "ge" else ("ge", d + 1)


def _region_of_ones(ones: fx.Node, seq: Any) -> Optional[bool]:
    val = _tensor(ones)
    ok = val is not None and val.dim() >= 2 and all(_same(d, 1) for d in val.shape[:-2]) \
        and _same(val.shape[-1], seq) and _same(val.shape[-2], seq)
    return True if ok else None


def _trivial_index(index: Any) -> bool:
    flat = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in flat)


def _causal(m: Match, seq: Any) -> Optional[List[fx.Node]]:
    """The mask-building nodes when the one mask of ``m`` is exactly causal, else None."""
    if m.biases or len(m.keeps) != 1:
        return None
    mask, keep = m.keeps[0].node, m.keeps[0].keep
    dead: List[fx.Node] = []
    region = _region(mask, seq, dead)
    if region is None:
        return None
    if not keep:  # the masked region: its complement is kept
        op, d = region
        region = ("le", d - 1) if op == "ge" else ("ge", d + 1)
    return dead if region == ("le", 0) else None


# -- the rewrite ------------------------------------------------------------------------------
def _key(em: FakeEmitter, kt: fx.Node) -> fx.Node:
    """k (..., S, D) from ``kT`` (..., D, S): the transpose's input when kT is one, else kT transposed."""
    nd, given = _tensor(kt).dim(), kt
    while _is(kt, {"contiguous", "clone"}) and len(kt.args) == 1 and not kt.kwargs:  # (k.transpose(..)).contiguous()
        kt = kt.args[0]
    if _is(kt, {"transpose", torch.transpose, "swapaxes", torch.swapaxes}) and len(kt.args) == 3:
        dims = {d % nd for d in kt.args[1:] if isinstance(d, int)}
        if dims == {nd - 2, nd - 1}:
            return kt.args[0]
    if _is(kt, {getattr}) and kt.args[1] in ("mT", "T") and (kt.args[1] == "mT" or nd == 2):
        return kt.args[0]
    if _is(kt, {"permute", torch.permute}):
        perm = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        perm = [p % nd if isinstance(p, int) else None for p in perm]
        if perm == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return kt.args[0]
    return em.method("transpose", given, -2, -1)


def _target_lead(lead: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """The (B, H) SDPA runs on: the softmax's two leading dims; one leading dim gets a head of 1."""
    return tuple(lead) if len(lead) == 2 else (tuple(lead) + (1,) if lead else (1, 1))


def _shape(em: FakeEmitter, node: fx.Node, lead: Tuple[Any, ...]) -> List[Any]:
    """``lead`` + ``node``'s last two dims, as reshape arguments (one symbolic size may become -1)."""
    dims = [d if isinstance(d, int) else None for d in lead] + [em.size(node, -2), em.size(node, -1)]
    if dims.count(None) > 1:
        raise RuntimeError("more than one symbolic leading dim")
    return [-1 if d is None else d for d in dims]


def _operand(em: FakeEmitter, op: Operand, lead: Tuple[Any, ...]) -> fx.Node:
    """q, k or v as (B, H, S, D) on ``lead``."""
    node = _key(em, op.node) if op.how == "T" else (em.fn(torch.einsum, op.how, op.node) if op.how else op.node)
    shape = _tensor(node).shape
    if len(shape) == len(lead) + 2 and all(_same(a, b) for a, b in zip(shape[:-2], lead)):
        return node
    return em.method("reshape", node, *_shape(em, node, lead))


def _regroup(em: FakeEmitter, term: Term, lead: Tuple[Any, ...]) -> fx.Node:
    """A bias, mask or row scale applied to scores of shape ``term.frame``, for scores on ``lead``."""
    shape, frame_lead = tuple(_tensor(term.node).shape), term.frame[:-2]
    if len(frame_lead) == len(lead) and all(_same(a, b) for a, b in zip(frame_lead, lead)):
        return term.node  # SDPA broadcasts it as the scores did
    shape = (1,) * (len(term.frame) - len(shape)) + shape
    if all(_same(d, 1) for d in shape[:-2]):
        return em.method("reshape", term.node, em.size(term.node, -2), em.size(term.node, -1))
    if all(_same(a, b) for a, b in zip(shape[:-2], frame_lead)):
        return em.method("reshape", term.node, *_shape(em, term.node, lead))
    raise RuntimeError(f"a mask or bias of shape {shape} broadcasts over part of the leading dims {frame_lead}")


def _mask(em: FakeEmitter, m: Match, lead: Tuple[Any, ...]) -> Optional[fx.Node]:
    """The one attn_mask of all the masks and biases (see the module docstring)."""
    keep = [_regroup(em, t, lead) for t in m.keeps]
    keep = [k if t.keep else em.fn(operator.invert, k) for k, t in zip(keep, m.keeps)]
    kept = keep[0] if keep else None
    for k in keep[1:]:
        kept = em.fn(operator.and_, kept, k)
    if not m.biases:
        return kept
    out = None
    for t in m.biases:
        b = _regroup(em, t, lead)
        b = b if t.coef == 1 else em.fn(operator.mul, b, t.coef)
        out = b if out is None else em.fn(operator.add, out, b)
    return out if kept is None else em.fn(torch.where, kept, out, float("-inf"))


def _emit(em: FakeEmitter, m: Match, causal: bool) -> fx.Node:
    """The SDPA of ``m`` and the ops that give it the final product's shape."""
    lead = _target_lead(m.lead)
    dtype = _tensor(m.out).dtype  # the products' (autocast casts their operands to it: attention_match._check)
    q, k, v = (_operand(em, op, lead) for op in (m.q, m.k, m.v))
    q, k, v = (x if _tensor(x).dtype == dtype else em.method("to", x, dtype) for x in (q, k, v))
    for t in m.row_scales:
        q = em.fn(operator.mul, q, _regroup(em, t, lead))
    mask = None if causal else _mask(em, m, lead)
    dtype = _tensor(q).dtype
    if mask is not None and _tensor(mask).dtype not in (torch.bool, dtype):
        mask = em.method("to", mask, dtype)
    if m.score_fn:  # f(scores) before the softmax: the same call with f (score_fn.py)
        out = em.fn(scaled_dot_product_attention_with_scores, q, k, v, attn_mask=mask, dropout_p=0.0,
                    is_causal=causal, scale=float(m.scale), score_fn=_module(em, build_score_fn(m.score_fn)))
    else:
        out = em.fn(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal,
                    scale=float(m.scale))
    wlead = m.weights_frame[:-2]
    if not (len(wlead) == len(lead) and all(_same(a, b) for a, b in zip(wlead, lead))):
        out = em.method("reshape", out, *_shape(em, out, wlead))
    if m.out_how:
        out = em.fn(torch.einsum, m.out_how, out)
    if _tensor(out).shape != _tensor(m.out).shape:
        raise RuntimeError(f"shape {tuple(_tensor(out).shape)} != {tuple(_tensor(m.out).shape)}")
    return out


def _written_in_place(node: fx.Node) -> bool:
    """Whether an op writes into ``node``'s value, directly or through a view of it (Nystromformer's
    ``context_layer += self.conv(value_layer)``)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user in seen or not user.args or user.args[0] is not n:
                continue
            seen.add(user)
            if writes_in_place(user):
                return True
            name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
            if name in ALIASING:
                todo.append(user)
    return False


def _module(em: FakeEmitter, fn: fx.GraphModule) -> fx.Node:
    """A ``get_attr`` of ``fn``, registered on the graph's module (its value: ``fn`` itself)."""
    owner = em.graph.owning_module
    name = next(f"_cp_score_fn_{i}" for i in range(1 << 20) if not hasattr(owner, f"_cp_score_fn_{i}"))
    owner.add_submodule(name, fn)
    with em.graph.inserting_before(em.anchor):
        node = em.graph.get_attr(name)
    node.meta["example_value"] = fn
    em.created.append(node)
    return node


def _replace(graph: fx.Graph, m: Match) -> bool:
    """Emit SDPA before the final product, reroute its users, erase the dead chain."""
    em = FakeEmitter(graph, m.out, m.q.node)
    causal_nodes = _causal(m, m.q.shape[-2])
    try:
        out = _emit(em, m, causal_nodes is not None)
    except Exception as e:  # a form the fake SDPA refuses (mask shape, dtype): leave the code as written
        em.undo()
        log.info("cp_compile: hand-written attention at %s left as written: %s", source_line(m.out), e)
        softmax = next(n for n in m.chain if is_softmax(n))
        set_facts(softmax, unfused=f"it could not be written as scaled_dot_product_attention ({e})")
        return False
    if _written_in_place(m.out):  # `out += x` on a matmul's result; SDPA keeps its output for the backward
        out = em.method("clone", out)
    m.out.replace_all_uses_with(out)
    kt_ops = [m.k.node] if m.k.how == "T" else []  # kT and the contiguous / transpose it came through
    while kt_ops and _is(kt_ops[-1], {"contiguous", "clone", "transpose", "permute", "swapaxes", torch.transpose,
                                      torch.permute, torch.swapaxes, getattr}) \
            and isinstance(kt_ops[-1].args[0], fx.Node):
        kt_ops.append(kt_ops[-1].args[0])
    for node in list(reversed(m.chain)) + kt_ops + (causal_nodes or []):  # users before their inputs
        for dead in dead_branch(node):  # a dead copy of the scores (dead_values.py)
            graph.erase_node(dead)
        if not getattr(node, "_erased", False) and not node.users and node.op in ("call_function", "call_method"):
            graph.erase_node(node)
    log.info("cp_compile: hand-written attention at %s became scaled_dot_product_attention%s",
             source_line(m.out), " (causal)" if causal_nodes is not None else "")
    return True
