"""FlexAttention in a Dynamo graph: what the ring op needs of it, and the BlockMask it does not need.

Dynamo (torch >= 2.5) records ``flex_attention(q, k, v, score_mod=..., block_mask=...)`` as one
higher-order op node::

    torch.ops.higher_order.flex_attention(
        q, k, v,                              # (B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
        score_mod_0,                          # get_attr: GraphModule(score, b, h, q_idx, kv_idx, *score_buffers)
        (S_q, S_kv, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
         q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
         ..., Q_BLOCK, KV_BLOCK, mask_fn_0),  # BlockMask.as_tuple(); the last item: get_attr of the mask_mod
        scale,                                # a float (flex's default 1/sqrt(D) already applied)
        kernel_options,                       # dict; OUTPUT_LOGSUMEXP / OUTPUT_MAX say which stats are read
        score_mod_other_buffers,              # tuple of the tensors score_mod captured (ALiBi slopes, ...;
                                              # learned ones may require grad: the ring returns their gradient)
        mask_mod_other_buffers,               # tuple of the tensors mask_mod captured (document ids, ...; constants)
    ) -> (out (B, Hq, S, Dv), lse (B, Hq, S) in log2 units, max_scores (B, Hq, S))

``create_block_mask`` inside the compiled function is traced into the graph (a vmap of the
mask_mod over the whole (S, S) grid, then block sums, argsorts and an index_put), while a
BlockMask passed as an argument arrives as graph inputs (its tensors); in both cases the
mask_mod subgraph is the tuple's last item. Without a block_mask, flex passes an all-true
mask_mod (``new_ones(dtype=bool)``) and blocks of 2**30; without a score_mod, the identity.

The ring evaluates the mask_mod per rectangle at global positions, so the pass
:mod:`..normalize.block_masks` takes the BlockMask tensors out of the node and erases the
O(S²) construction that fed them.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any, Optional, Set, Tuple

import torch
import torch.fx as fx

from ..context import CPRewriteError
from ..fx_utils import fake_value, source_line
from ..node_facts import facts, set_facts

FLEX_HOP = getattr(torch.ops.higher_order, "flex_attention", None)
BLOCKS_OF_NO_MASK = 1 << 30  # flex's block size for "no block_mask given" (_LARGE_SPARSE_BLOCK_SIZE)


def is_flex(node: fx.Node) -> bool:
    """Whether ``node`` is FlexAttention's higher-order op."""
    return FLEX_HOP is not None and node.op == "call_function" and node.target is FLEX_HOP


@dataclass
class FlexSpec:
    """What the ring op takes from one flex_attention node (mods as subgraphs, buffers as old nodes)."""

    mask_mod: Optional[fx.GraphModule]  # None: every key visible (no block_mask, or an all-true mask_mod)
    score_mod: Optional[fx.GraphModule]  # None: the identity (flex's default)
    scale: float
    score_buffers: Tuple[fx.Node, ...]
    mask_buffers: Tuple[fx.Node, ...]
    lse: bool  # the graph reads the log-sum-exp (return_lse / return_aux=AuxRequest(lse=True))
    lse_log2: bool = True  # the op's lse is in log2 units (every backend but BACKEND="FLASH")


def _items_read(node: fx.Node) -> Set[Any]:
    """Which items of the node's output tuple the graph reads (None: used whole)."""
    return {u.args[1] if u.target is operator.getitem else None for u in node.users}


def _returns(sub: fx.GraphModule) -> Any:
    (out,) = [n for n in sub.graph.nodes if n.op == "output"]
    ret = out.args[0]
    return ret[0] if isinstance(ret, (tuple, list)) and len(ret) == 1 else ret


def _is_identity(sub: fx.GraphModule) -> bool:
    """score_mod(score, ...) that returns its score untouched."""
    first = next(n for n in sub.graph.nodes if n.op == "placeholder")
    return _returns(sub) is first


def _is_all_true(sub: fx.GraphModule) -> bool:
    """flex's noop_mask: ``b.new_ones((), dtype=torch.bool)`` (or a constant True)."""
    ret = _returns(sub)
    if ret is True:
        return True
    return (isinstance(ret, fx.Node) and ret.op == "call_method" and ret.target == "new_ones"
            and ret.kwargs.get("dtype") is torch.bool and len(ret.users) == 1)


def _buffers(node: fx.Node, arg: Any, what: str) -> Tuple[fx.Node, ...]:
    for b in arg:
        val = fake_value(b) if isinstance(b, fx.Node) else b
        if not isinstance(val, torch.Tensor):
            raise CPRewriteError(
                f"cp_compile: the {what} of flex_attention at {source_line(node)} captures {val!r}, not a tensor; "
                "the ring passes only tensors to mods. Fix: make the captured value a tensor (e.g. a buffer) or a "
                "Python constant of the mod.")
        if val.requires_grad and what == "mask_mod":
            raise CPRewriteError(
                f"cp_compile: the mask_mod of flex_attention at {source_line(node)} reads {b.name}, which requires "
                "grad; a mask_mod's result is boolean, so the ring treats its buffers as constants and would drop "
                "that gradient. Fix: detach it if it is not trained, or read it in the score_mod (a learned bias "
                "there trains: the ring's backward returns its gradient).")
    return tuple(arg)


def _user_frames_only(node: fx.Node) -> None:
    """Drop torch's own frames (flex_attention's body) from the node's stack trace, so that
    source_line, the record and explain name the model's flex_attention call."""
    lines = (node.meta.get("stack_trace") or "").splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.strip().startswith("File ")] + [len(lines)]
    frames = ["".join(lines[a:b]) for a, b in zip(starts, starts[1:])]
    user = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.split(",")[0]]
    if user and len(user) < len(frames):
        node.meta["stack_trace"] = "".join(lines[:starts[0]] + user)


def _check_heads(node: fx.Node) -> int:
    """q/k/v shapes the ring can take; returns S."""
    shapes = [tuple(fake_value(x).shape) if isinstance(fake_value(x), torch.Tensor) else None for x in node.args[:3]]
    where = source_line(node)
    if any(s is None or len(s) != 4 for s in shapes):
        raise CPRewriteError(f"cp_compile: flex_attention at {where} must take 4-D (B, H, S, D) q/k/v.")
    (_, hq, sq, _), (_, hk, sk, _), (_, hv, sv, _) = shapes
    if not sq == sk == sv:
        raise CPRewriteError(
            f"cp_compile: flex_attention at {where} has q/k/v sequence lengths {sq}/{sk}/{sv}; context parallelism "
            "needs self-attention over one sequence. Fix: run cross-attention without ring_cp.")
    if hk != hv or hq % hk:
        raise CPRewriteError(
            f"cp_compile: flex_attention at {where} has q/k/v heads {hq}/{hk}/{hv}; the ring needs equal k/v heads "
            "and H_q a multiple of them (enable_gqa=True's grouping). Fix: repeat the k/v heads before the call.")
    return sq


def parse_flex(gm: fx.GraphModule, node: fx.Node) -> FlexSpec:
    """The :class:`FlexSpec` of ``node`` (cached in its :mod:`..node_facts`), or a CPRewriteError naming the fix."""
    if facts(node).flex is not None:
        return facts(node).flex
    _user_frames_only(node)
    where = source_line(node)
    _check_heads(node)
    score_get, block, scale, options, score_bufs, mask_bufs = (list(node.args) + [(), ()])[3:9]
    if options.get("OUTPUT_MAX") or 2 in _items_read(node):
        raise CPRewriteError(
            f"cp_compile: flex_attention at {where} returns max_scores (return_aux=AuxRequest(max_scores=True)); "
            "the ring op does not compute them. Fix: request only lse, or none.")
    _refuse_lse_gradient(node)
    if not isinstance(scale, (int, float)):
        raise CPRewriteError(f"cp_compile: flex_attention at {where} takes a scale that is a graph value "
                             f"({scale}). Fix: pass a Python float scale (or none: 1/sqrt(D)).")
    score_mod = getattr(gm, score_get.target) if isinstance(score_get, fx.Node) else None
    mask_get = block[-1] if isinstance(block, (tuple, list)) and block else None
    mask_mod = getattr(gm, mask_get.target) if isinstance(mask_get, fx.Node) and mask_get.op == "get_attr" else None
    if mask_mod is None:
        raise CPRewriteError(
            f"cp_compile: the BlockMask of flex_attention at {where} has no mask_mod (built from block tensors "
            "only), and the ring can only evaluate a mask_mod at global positions. Fix: build it with "
            "create_block_mask(mask_mod, B, H, S, S).")
    if _is_all_true(mask_mod):
        _refuse_blocks_without_mask_mod(node, block)
        mask_mod = None
    spec = FlexSpec(
        mask_mod=mask_mod, score_mod=None if score_mod is None or _is_identity(score_mod) else score_mod,
        scale=float(scale), score_buffers=_buffers(node, score_bufs, "score_mod"),
        mask_buffers=_buffers(node, mask_bufs, "mask_mod"),
        lse=bool(options.get("OUTPUT_LOGSUMEXP")) or 1 in _items_read(node),
        lse_log2=options.get("BACKEND") != "FLASH")
    set_facts(node, flex=spec)
    return spec


def _refuse_lse_gradient(node: fx.Node) -> None:
    """The ring's lse carries no gradient: refuse an lse read where autograd would need one."""
    todo = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    seen: Set[fx.Node] = set()
    while todo:  # forward from the lse through values autograd tracks (a detach ends the walk)
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        val = fake_value(n)
        todo += [u for u in n.users if isinstance(val, torch.Tensor) and val.requires_grad]
        if n.op == "output":
            raise CPRewriteError(
                f"cp_compile: flex_attention at {source_line(node)} returns its lse (return_aux=AuxRequest(lse=True) "
                "or return_lse=True) where autograd tracks it, and the ring op's lse has no gradient (the loss "
                "would silently miss that term). Fix: use lse.detach(), compute it under torch.no_grad(), or do "
                "not request it.")


def _refuse_blocks_without_mask_mod(node: fx.Node, block: Tuple) -> None:
    """An all-true mask_mod is full attention only if the blocks say so too: flex's own "no block_mask"
    (blocks of 2**30) or create_block_mask(noop_mask) traced here (a vmap in the graph). A BlockMask
    passed in with an all-true mask_mod (BlockMask.from_kv_blocks) holds its sparsity in tensors alone."""
    if block[-3] == BLOCKS_OF_NO_MASK and block[-2] == BLOCKS_OF_NO_MASK:
        return
    kv_num_blocks = block[2]
    seen, todo = set(), [kv_num_blocks] if isinstance(kv_num_blocks, fx.Node) else []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _name(n) == "_add_batch_dim":
            return  # create_block_mask traced in this graph: the blocks come from the mask_mod
        todo.extend(n.all_input_nodes)
    raise CPRewriteError(
        f"cp_compile: the BlockMask of flex_attention at {source_line(node)} has no mask_mod (built from block "
        "tensors, e.g. BlockMask.from_kv_blocks), so which keys each query sees is known only block by block and "
        "the ring cannot evaluate it at global positions. Fix: build it with create_block_mask(mask_mod, B, H, S, S), "
        "or pass block_mask=None for full attention.")


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""
