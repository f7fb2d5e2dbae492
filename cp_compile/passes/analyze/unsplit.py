"""Attention that does not become the ring, in any form: found, and named with the reason.

Before: a Dynamo graph after :mod:`.fuse_attention` and :mod:`.find_attention` (which hold the
attention the ring replaces). After: the same graph, and ``ctx.unsplit`` lists every other op
that computes attention, with its source line and why it is not the ring. An op is attention
when it is

* ``F.multi_head_attention_forward`` left opaque (:mod:`.expand_mha` opens every one it can);
* a softmax or logsumexp over a dim of length L whose input depends on a product (matmul,
  ``@``, bmm, baddbmm, einsum) of two operands that each keep a dim of length L in the product
  (the (.., L, L) scores of q and k) and each read an input or activation (not only weights);
* a higher-order op whose body holds attention (SDPA, FlexAttention or either form above) and
  that :mod:`.regions` did not open: control flow (``torch.cond``, ``torch.while_loop``, ...).
  Activation-checkpointed regions and nested compile regions are opened before this pass runs.

A weight matrix is no sequence (the vocabulary softmax of ``h @ Wᵀ`` is not attention), and
cross-attention of two lengths is not self-attention over one sequence. Every op found is
logged as a WARNING once per source line (or raised under ``strict=True``): in a graph with no
ring attention, every rank then runs the graph on the whole sequence; in a graph with ring
attention, this one is computed on the gathered sequence (exact, not memory-scalable), and the
gathers are warned too. ``cp-compile explain`` prints ``ctx.unsplit`` from this same pass.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from ..normalize.attention_match import einsum_parts, is_softmax, match_attention
from ..context import CPRewriteError, RewriteContext, fake_value, log, source_line
from ..node_facts import facts
from .graph_inputs import is_parameter_like
from ..op_vocab import BADDBMM, EINSUM, MATMUL, SDPA_TARGETS, arguments, is_, tensor
from ...warn_once import warn_once

OPAQUE_ATTENTION = ("multi_head_attention_forward",)
REGIONS = {"cond": "torch.cond", "while_loop": "torch.while_loop", "map_impl": "torch.map",
           "scan": "torch.scan"}  # checkpointed and nested compile regions are opened first (passes/regions.py)
LOGSUMEXP = {torch.logsumexp, "logsumexp", torch.special.logsumexp}
DEPTH = 24  # how many ops above a softmax its scores may come from the product (scales, masks, casts, views)
FIX = ("Fix: F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...) computes the same without "
       "the L x L scores, and ring_cp turns it into ring attention")



def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


class _Data:
    """Which nodes read a model input or an activation (not only parameters, buffers and constants)."""

    def __init__(self) -> None:
        self.memo: Dict[fx.Node, bool] = {}

    def __call__(self, node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return False
        if node not in self.memo:
            self.memo[node] = False  # a cycle cannot happen in a graph; this bounds re-entry
            if node.op == "placeholder":
                val = fake_value(node)
                self.memo[node] = isinstance(val, torch.Tensor) and not is_parameter_like(node, _example(node))
            else:
                self.memo[node] = any(self(a) for a in node.all_input_nodes)
        return self.memo[node]


def _example(node: fx.Node) -> Any:
    try:
        return node.meta["grapharg"].example if node.meta.get("grapharg") is not None else None
    except AssertionError:  # its weak reference expired
        return None


def _kept_pair(node: fx.Node) -> Optional[tuple]:
    """(a, b, L): the operands of a product that keeps a dim of length L from each, else None."""
    if is_(node, MATMUL) and len(node.args) == 2:
        a, b = node.args
    elif is_(node, BADDBMM):
        found = arguments(node, ("input", "batch1", "batch2"))
        a, b = found["batch1"], found["batch2"]
    elif is_(node, EINSUM):
        return _einsum_pair(node)
    else:
        return None
    av, bv = tensor(a), tensor(b)
    if av is None or bv is None or av.dim() < 2 or bv.dim() < 2:
        return None
    n, m = av.shape[-2], bv.shape[-1]
    return (a, b, n) if isinstance(n, int) and n == m else None


def _einsum_pair(node: fx.Node) -> Optional[tuple]:
    parts = einsum_parts(node)
    if parts is None or len(parts[0]) != 2:
        return None
    (sa, sb), out, (a, b) = parts
    size_a, size_b = dict(zip(sa, tensor(a).shape)), dict(zip(sb, tensor(b).shape))
    only_a = {size_a[c] for c in out if c in sa and c not in sb}
    only_b = {size_b[c] for c in out if c in sb and c not in sa}
    common = [n for n in only_a & only_b if isinstance(n, int)]
    return (a, b, common[0]) if common else None


def _products(node: fx.Node, length: Any) -> List[fx.Node]:
    """The products above ``node`` (within DEPTH ops) whose two operands keep a dim of ``length``."""
    found, seen, frontier = [], set(), [node]
    for _ in range(DEPTH):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                pair = _kept_pair(a)
                if pair is not None and pair[2] == length:
                    found.append(a)
                else:
                    nxt.append(a)
        frontier = nxt
    return found


def _reduced_length(node: fx.Node) -> Any:
    """The length of the dim a softmax / logsumexp reduces, or None."""
    found = arguments(node, ("input", "dim"))
    x, dim = found["input"], found.get("dim")
    val = tensor(x)
    if val is None or val.dim() < 2:
        return None
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    return val.shape[dim] if isinstance(dim, int) else None


def _attention_why(node: fx.Node, data: _Data) -> Optional[str]:
    """Why ``node``, a softmax / logsumexp over attention scores, is not the ring; None: not attention."""
    length = _reduced_length(node)
    if not isinstance(length, int) or length < 2:
        return None
    pairs = [_kept_pair(p) for p in _products(node, length)]
    if not any(data(a) and data(b) for a, b, _ in pairs):
        return None  # no product of two sequences (a weight matrix is none)
    if is_(node, LOGSUMEXP):
        return "attention written with logsumexp (exp(s - logsumexp(s)) @ v) is not recognised"
    why = facts(node).unfused or match_attention(node)[1]
    return why or "its scores or weights are not in a form ring_cp recognises (softmax(q·kᵀ·scale + bias)·v)"


def _bodies(node: fx.Node) -> List[fx.GraphModule]:
    """The subgraphs a higher-order op call runs (its ``get_attr`` operands that are graphs)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    root = node.graph.owning_module
    found = [getattr(root, a.target, None) for a in node.all_input_nodes if a.op == "get_attr"]
    return [b for b in found if isinstance(b, fx.GraphModule)]


def _attention_in(body: fx.GraphModule) -> int:
    """How many attention ops ``body`` (and the bodies inside it) computes. Its placeholders are
    the region's operands, activations and lifted weights alike, so each counts as data."""
    data = _Data()
    data.memo.update({n: True for n in body.graph.find_nodes(op="placeholder")})
    count = 0
    for n in body.graph.nodes:
        if is_(n, SDPA_TARGETS) or (n.op == "call_function" and "flex_attention" in _name(n)):
            count += 1
        elif is_softmax(n) or is_(n, LOGSUMEXP):
            count += _attention_why(n, data) is not None
        count += sum(_attention_in(b) for b in _bodies(n))
    return count


def _region_why(node: fx.Node) -> Optional[str]:
    count = sum(_attention_in(b) for b in _bodies(node))
    if not count:
        return None
    name = _name(node)
    kind = REGIONS.get(name, "a higher-order op")
    return (f"{count} attention op(s) inside the body of {name} ({kind}): ring_cp opens activation-"
            "checkpointed regions and nested compile regions, not control-flow bodies, which run once per "
            "branch or step. Fix: compute the attention outside the control flow (a Python if/for, which "
            "Dynamo unrolls, or the branch's result selected with torch.where)")


def _why(node: fx.Node, data: _Data) -> Optional[str]:
    if node.op not in ("call_function", "call_method"):
        return None
    region = _region_why(node)
    if region:
        return region
    name = _name(node)
    if node.op == "call_function" and any(op in name for op in OPAQUE_ATTENTION):
        return (f"{name} (nn.MultiheadAttention / nn.Transformer* layers) is one opaque op to ring_cp. Fix: "
                "write the layer's attention with F.scaled_dot_product_attention (its q/k/v projections as "
                "nn.Linear), which ring_cp turns into ring attention")
    if is_softmax(node) or is_(node, LOGSUMEXP):
        why = _attention_why(node, data)
        return f"{why}. {FIX}" if why else None
    return None


def find_unsplit_attention(gm: fx.GraphModule, ctx: RewriteContext) -> List[str]:
    """Fill ``ctx.unsplit`` with the attention ops that are not the ring; warn (or raise under strict)."""
    data = _Data()
    ctx.unsplit = [f"{source_line(n)}: {why}" for n in gm.graph.nodes for why in [_why(n, data)] if why]
    effect = ("It runs on the sequence gathered on every rank (exact, not memory-scalable)." if ctx.attention else
              "This graph gets no context parallelism: every rank runs it on the whole sequence.")
    for line in ctx.unsplit:
        message = f"cp_compile: attention that ring_cp cannot split, at {line}. {effect}"
        if ctx.options.strict:
            raise CPRewriteError(message + " (strict=True)")
        warn_once(log, "unsplit attention", line, "%s", message)
    return ctx.unsplit
