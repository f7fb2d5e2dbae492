"""Rule: FlexAttention (``torch.ops.higher_order.flex_attention``) -> ring attention with its mods.

find_attention parsed the node (:class:`..find_flex.FlexSpec`) and took its BlockMask away; here::

    flex_attention(q, k, v, score_mod, (.., mask_mod), scale, opts, score_bufs, mask_bufs)
        -> ring_attention_fwd(q[rank rows], k[rank rows], v[rank rows], causal=False, scale, ...,
                              mods=register_mods(mask_mod, score_mod), mask_buffers=[whole], score_buffers=[whole])
        -> (out (B, H, c, Dv), lse (B, H, c) / ln 2, empty max_scores)

Positions given to the mods are global (the ring's), so a mask_mod written for the whole
sequence means the same on every rank. The buffers the mods read (document ids, per-head
slopes) go whole: a buffer sharded along the sequence here is gathered (an all-gather of
its c rows per rank, e.g. 8 bytes a token for int64 document ids).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from ...context import CPRewriteError, global_shape, source_line
from ...analyze.find_flex import FLEX_HOP, parse_flex
from ..placements import Sharded
from .attention import _as_seq_sharded, emit_ring
from .registry import register_rule

LOG2E = 1.0 / math.log(2.0)  # flex's op gives lse in log2 units (flex multiplies by ln 2 after it)


def flex_outputs(ring: Tuple[torch.Tensor, torch.Tensor], log2: bool = True
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring op's (out, lse) as flex's op returns them: (out, lse (log2 units unless BACKEND="FLASH"),
    max_scores: empty, never read)."""
    out, lse = ring  # (B, H, c, Dv), (B, H, c) natural log
    return out, lse * LOG2E if log2 else lse, lse.new_empty(0)


def call_subgraph(sub: fx.GraphModule, *args: Any) -> Any:
    """A mod subgraph called through its generated ``forward``: the ring retries a mod that fails
    under vmap by broadcasting, and GraphModule.__call__ would print each such failure to stderr."""
    return sub.forward(*args)


def _as_mod(sub: Optional[fx.GraphModule]) -> Optional[Callable]:
    if sub is None:
        return None
    mod = functools.partial(call_subgraph, sub)  # hashed by the subgraph's code
    mod.__name__ = "from flex_attention"  # what the record names it (Dynamo's score_mod_0 / mask_fn_0 say nothing)
    return mod


def _whole(em, buf: fx.Node, node: fx.Node) -> fx.Node:
    """A mod buffer as every rank needs it: whole (gathered if the rewrite sharded it)."""
    lay = em.layout(buf)
    if not isinstance(lay, Sharded):
        if em.ctx.options.inputs == "local" and buf.op == "placeholder" and buf.name in em.ctx.shard_inputs:
            raise CPRewriteError(
                f"cp_compile: flex_attention at {source_line(node)} reads {buf.name} in a mod, a sequence input "
                "passed as this rank's shard (inputs='local'); mods index it by global position. Fix: pass it "
                "whole (leave it out of seq_inputs), or inputs='full'.")
        return em.env[buf]
    if lay.inner != 1 or lay.dim >= len(buf.meta["example_value"].shape):
        raise CPRewriteError(
            f"cp_compile: flex_attention at {source_line(node)} reads {buf.name} in a mod, and the rewrite holds it "
            f"split in a way it cannot gather (sequence merged into dim {lay.dim}). Fix: compute it from whole "
            "values (e.g. a module buffer), or report this model pattern.")
    gathered = em.__dict__.setdefault("flex_gathered", {})  # one gather per buffer, shared by the layers
    if buf not in gathered:
        gathered[buf] = em.to_global(buf)
    return gathered[buf]


def _drop_subgraph_reads(em, node: fx.Node) -> None:
    """The new graph's get_attr of this node's mod subgraphs, read by nothing now (the ring op holds
    the mods by key): erased, so the rewritten module does not carry them."""
    for old in (node.args[3], node.args[4][-1]):
        new = em.env.get(old) if isinstance(old, fx.Node) and old.op == "get_attr" else None
        if new is not None and not new.users and list(old.users) == [node]:
            em.graph.erase_node(new)


@register_rule(FLEX_HOP)
def flex(em, node: fx.Node) -> Tuple[Any, Any]:
    """ring_attention_fwd in place of one flex_attention node; its layouts per output item."""
    from ....ring.mods import register_mods

    spec = parse_flex(em.gm, node)
    q, k, v = node.args[:3]
    mods = register_mods(mask_mod=_as_mod(spec.mask_mod), score_mod=_as_mod(spec.score_mod))
    extra: Dict[str, Any] = {}
    if mods:
        extra["mods"] = mods
        if spec.mask_buffers:
            extra["mask_buffers"] = [_whole(em, b, node) for b in spec.mask_buffers]
        if spec.score_buffers:
            extra["score_buffers"] = [_whole(em, b, node) for b in spec.score_buffers]
    if em.index.table is not None:  # load_balance="documents" (passes/doc_table.py)
        extra["positions"] = em.index.table
    qkv = tuple(_as_seq_sharded(em, x, node) for x in (q, k, v))
    ring = emit_ring(em, qkv, (global_shape(q)[1], global_shape(k)[1]), False, spec.scale, extra)
    _drop_subgraph_reads(em, node)
    return em.call(flex_outputs, ring, spec.lse_log2), (Sharded(2), Sharded(2), None)



__all__: List[str] = ["call_subgraph", "flex", "flex_outputs"]
