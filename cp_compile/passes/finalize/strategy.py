"""Each ring op of the rewritten graph run by its strategy: the ring, Ulysses, or 2-D (Ulysses x ring).

Before (every attention the ring over the N ranks of the CP group)::

    (out, lse) = ring_attention_fwd(q, k, v, causal, scale, "cp", "zigzag", ...)      # (B, H, c, D)

After, for an attention given Ulysses over u ranks x the ring over r = N/u (``ulysses``: r = 1)::

    q2 = seq_to_heads(q, q_slots, u, "row i", "cp", "zigzag")                          # (B, Hp/u, u·c, D)
    k2 = seq_to_heads(k, kv_slots, u, ...); v2 = ...                                   # (B, m, u·c, D)
    (o2, lse) = ring_attention_fwd(q2, k2, v2, causal, scale, "column j", "zigzag" over r, ...,
                                   mods=<mods reading head_map[h]>, mask_buffers=[..., head_map])
    out = heads_to_seq(o2, H, q_slots, u, ...)                                         # (B, H, c, D)

Nothing outside the attention changes: the layout, positions, losses and gradient sync stay the
N-rank ones. What carries over into the attention, argument by argument: positions (the row's tokens
sorted, which zig-zag / contiguous over N make zig-zag / contiguous over r; a ``positions`` table
becomes the rows' positions sorted; striped needs a constant table: static S), ``valid_len``,
``window`` and ``doc_ids`` (global, unchanged), an explicit mask (its rows go with the queries: a
per-query mask travels by the same all-to-all, a broadcast row keeps its row and picks its heads),
mask_mod / score_mod (they index heads by the global head: ``head_map`` appended to their buffers).

The decision per ring op (:func:`cp_compile.ulysses.choose.choose`) is recorded on the node
(``facts(node).ring_call``: ``strategy``, ``ulysses``, ``why``), where the record and ``cp-compile
explain`` read it; a forced strategy that cannot run an attention logs a WARNING saying why.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher

from ... import graph_ops
from ...hardware import default_hardware, parse_hardware
from ...ring.call_spec import RING_FWD, ring_arguments
from ...ring.mods import lookup, register_mods
from ...sequence import rank_positions
from ...ulysses import ops as _ops  # noqa: F401 (registers the all-to-all ops)
from ...ulysses.choose import Decision, choose
from ...ulysses.cost import AttentionShape
from ...ulysses.groups import sub_groups, synthetic_name
from ...ulysses.heads import HeadPlan
from ..context import RewriteContext, log, source_line
from ..fx_utils import rows_per_query, stored_bytes, to_int
from ..node_facts import facts, set_facts
from ..ring_call import ring_call
from ...warn_once import warn_once

SEQ_TO_HEADS = torch.ops.cp_compile.seq_to_heads.default
HEADS_TO_SEQ = torch.ops.cp_compile.heads_to_seq.default


def apply_strategy(gm: fx.GraphModule, ctx: RewriteContext) -> None:
    """Run each ring op by the strategy chosen for it (module docstring); record the choice on it."""
    rings = list(gm.graph.find_nodes(op="call_function", target=RING_FWD))
    if not rings or ctx.options.strategy == "ring":
        return  # every ring op stays as emitted (its description's defaults say "ring")
    hw = parse_hardware(ctx.options.hardware) if ctx.options.hardware else default_hardware(_device(rings[0]))
    for i, node in enumerate(rings):
        args = ring_arguments(node)
        where = source_line(ctx.attention[i]) if i < len(ctx.attention) else source_line(node)
        decision = choose(ctx.options.strategy, ctx.world, ctx.options.ulysses_degree, _shape(args, ctx),
                          _blocker(args, ctx), hw)
        set_facts(node, ring_call=replace(ring_call(node), strategy=decision.strategy, ulysses=decision.u,
                                          why=decision.why))
        if decision.fell_back:  # once per line and reason
            warn_once(log, "strategy", (where, decision.why), "cp_compile: attention at %s: %s", where, decision.why)
        else:
            log.info("cp_compile: attention (node %s): %s", node.name, decision.text)
        if decision.u > 1:
            before = set(gm.graph.nodes)
            _split_heads(gm, node, args, decision, ctx)
            _same_region(gm, node, before)
    gm.graph.lint()
    gm.recompile()


def _same_region(gm: fx.GraphModule, ring: fx.Node, before: set) -> None:
    """The nodes added around ``ring`` join its checkpointed region, if any: the all-to-alls communicate,
    so the region's tagging saves them rather than recomputing them in the backward, as the ring op."""
    region = facts(ring).region
    if region is not None:
        for n in gm.graph.nodes:
            if n not in before:
                set_facts(n, region=region)


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _device(node: fx.Node) -> str:
    q = _val(ring_arguments(node)["q"])
    return q.device.type if isinstance(q, torch.Tensor) else "cpu"


def _shape(args: Dict[str, Any], ctx: RewriteContext) -> Optional[AttentionShape]:
    """The attention's whole-sequence sizes (None when the heads or sizes are symbolic)."""
    q, k = _val(args["q"]), _val(args["k"])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return None
    if not (isinstance(q.shape[1], int) and isinstance(k.shape[1], int)):
        return None  # the heads decide the split: symbolic, nothing to plan by
    dims = (to_int(q.shape[0]), q.shape[1], k.shape[1], to_int(q.shape[3]))  # a symbolic batch priced at its hint
    if not all(isinstance(d, int) for d in dims):
        return None
    mask_bytes, mask_heads = _per_query_mask(_val(args.get("attn_mask")))
    return AttentionShape(*dims, ctx.padded_len, q.element_size(), bool(args["causal"]), mask_bytes, mask_heads)


def _per_query_mask(m: Any) -> Tuple[int, int]:
    """(bytes held, head dim) of an explicit mask whose rows differ by query; (0, 1) otherwise."""
    if not rows_per_query(m):
        return 0, 1
    heads = to_int(m.shape[1])
    return stored_bytes(m), heads if isinstance(heads, int) else 1


def _blocker(args: Dict[str, Any], ctx: RewriteContext) -> str:
    """Why Ulysses cannot run this ring call ("" when it can). A ring over r > 1 ranks after the all-to-all
    needs a positions table under striped, fixed per length; Ulysses alone (r = 1) needs none."""
    if ctx.options.load_balance == "striped" and ctx.seq_sym is not None and ctx.options.strategy != "ulysses":
        return "the striped layout under a symbolic sequence length (the ring's positions table is per length)"
    if args.get("positions") is None and ctx.options.load_balance == "documents":
        return "a documents layout without its positions table"
    return ""


def _split_heads(gm: fx.GraphModule, node: fx.Node, args: Dict[str, Any], d: Decision, ctx: RewriteContext) -> None:
    """Wrap ``node`` in the all-to-alls of :class:`Decision` ``d`` (module docstring's "After")."""
    q, k = _val(args["q"]), _val(args["k"])
    plan = HeadPlan(q.shape[1], k.shape[1], d.u)
    uly, ring = sub_groups(ctx.group, d.u)
    lb, table = ctx.options.load_balance, args.get("positions")
    a2a = dict(u=d.u, group_name=_name(uly, "ulysses", ctx, d.u), cp_name=ctx.group.name, load_balance=lb,
               positions=table)
    with gm.graph.inserting_before(node):
        new = {"q": _call(gm, SEQ_TO_HEADS, args["q"], heads=plan.q_index(), **a2a)}
        for name in ("k", "v"):
            new[name] = _call(gm, SEQ_TO_HEADS, args[name], heads=plan.kv_index(), **a2a)
        head_map = _const(gm, f"_cp_head_map_{node.name}", torch.tensor(plan.head_map(uly.rank)))
        new.update(_ring_layout(gm, d, ctx, table, node))
        new["group_name"] = _name(ring, "ring", ctx, d.u)
        if args.get("attn_mask") is not None:
            new["attn_mask"] = _mask(gm, args["attn_mask"], plan, head_map, a2a)
        if args.get("mods"):
            new.update(_head_mapped_mods(args, head_map))
    _set_args(node, new)
    _refresh(node)
    _outputs_back(gm, node, plan, a2a)


def _name(g: Any, kind: str, ctx: RewriteContext, u: int) -> str:
    """A sub-group's registered name; a synthetic one under a synthetic CP group (explain)."""
    if g.size == 1:
        return ""
    return g.name if g.pg is not None else synthetic_name(kind, ctx.group, u)


def _ring_layout(gm: fx.GraphModule, d: Decision, ctx: RewriteContext, table: Any, node: fx.Node) -> Dict[str, Any]:
    """The ring's layout over r ranks: the rows' tokens sorted (see the module docstring)."""
    lb = ctx.options.load_balance
    if d.r == 1:
        return {"load_balance": "contiguous", "positions": None}
    if table is not None:  # documents: the rows' positions, sorted
        rows = gm.graph.call_method("view", (table, d.r, -1))
        return {"load_balance": lb, "positions": _refresh(gm.graph.call_function(
            operator.getitem, (_refresh(gm.graph.call_method("sort", (_refresh(rows), 1))), 0)))}
    if lb in ("zigzag", "contiguous"):
        return {"load_balance": lb}
    n, s = ctx.world, ctx.padded_len  # striped: a constant table
    rows = [torch.cat([rank_positions(s, n, i * d.u + j, lb) for j in range(d.u)]).sort().values for i in range(d.r)]
    return {"positions": _const(gm, f"_cp_ring_table_{node.name}", torch.stack(rows))}


def _mask(gm: fx.GraphModule, mask: fx.Node, plan: HeadPlan, head_map: fx.Node, a2a: Dict[str, Any]) -> fx.Node:
    """An explicit mask for the head-sharded call: per-query rows travel with the queries; a row
    broadcast over the queries keeps its row and takes this rank's heads."""
    m = _val(mask)
    if rows_per_query(m):  # (B|1, H|1, c, S): rows of this rank's queries
        heads = plan.q_index() if to_int(m.shape[1]) != 1 else [0] * plan.u
        return _call(gm, SEQ_TO_HEADS, mask, heads=heads, **a2a)
    if to_int(m.shape[1]) == 1:
        return mask
    return _refresh(gm.graph.call_function(torch.ops.aten.index_select.default, (mask, 1, head_map)))


def _head_mapped_mods(args: Dict[str, Any], head_map: fx.Node) -> Dict[str, Any]:
    """The call's mods re-registered to index heads by ``head_map[h]`` (appended to their buffers)."""
    mods = lookup(args["mods"])
    mask_mod = None if mods.mask_mod is None else functools.partial(_mask_on_global_heads, mods.mask_mod)
    score_mod = None if mods.score_mod is None else functools.partial(_score_on_global_heads, mods.score_mod)
    out: Dict[str, Any] = {"mods": register_mods(mask_mod, score_mod)}
    if mask_mod is not None:
        out["mask_buffers"] = [*(args.get("mask_buffers") or []), head_map]
    if score_mod is not None:
        out["score_buffers"] = [*(args.get("score_buffers") or []), head_map]
    return out


def _mask_on_global_heads(mask_mod: Any, b: Any, h: Any, q: Any, kv: Any, *buffers: Any) -> Any:
    """``mask_mod`` with the local head ``h`` read as the global head ``buffers[-1][h]``."""
    return mask_mod(b, buffers[-1][h], q, kv, *buffers[:-1])


def _score_on_global_heads(score_mod: Any, score: Any, b: Any, h: Any, q: Any, kv: Any, *buffers: Any) -> Any:
    """``score_mod`` with the local head ``h`` read as the global head ``buffers[-1][h]``."""
    return score_mod(score, b, buffers[-1][h], q, kv, *buffers[:-1])


def _outputs_back(gm: fx.GraphModule, node: fx.Node, plan: HeadPlan, a2a: Dict[str, Any]) -> None:
    """``out`` / ``lse`` of the head-sharded call put back in sequence shards for every user: a
    ``getitem``'s users read its value put back; a user of the whole (out, lse) pair (FlexAttention's
    outputs) reads the pair of both put back."""
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    whole = [u for u in node.users if u.target is not operator.getitem]
    with gm.graph.inserting_after(node):
        for i in (0, 1) if whole else ():
            if i not in items:
                items[i] = gm.graph.call_function(operator.getitem, (node, i))
    back: Dict[int, fx.Node] = {}
    for i, item in sorted(items.items(), key=lambda kv: kv[0]):
        users = list(item.users)
        _refresh(item)
        if not users and not whole:
            continue
        with gm.graph.inserting_after(item):
            back[i] = _call(gm, HEADS_TO_SEQ, item, n_heads=plan.heads, heads=plan.q_index(), **a2a)
        for user in users:
            user.replace_input_with(item, back[i])
    if whole:
        first = next(n for n in gm.graph.nodes if n in whole)
        with gm.graph.inserting_before(first):
            pair = _refresh(gm.graph.call_function(graph_ops.ring_outputs, (back[0], back[1])))
        for user in whole:
            user.replace_input_with(node, pair)


def _call(gm: fx.GraphModule, target: Any, x: fx.Node, **kwargs: Any) -> fx.Node:
    return _refresh(gm.graph.call_function(target, (x,), kwargs))


def _const(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> fx.Node:
    gm.register_buffer(name, tensor, persistent=False)
    node = gm.graph.get_attr(name)
    node.meta["val"] = tensor
    return node


def _set_args(node: fx.Node, new: Dict[str, Any]) -> None:
    """Replace the ring op's arguments named in ``new`` (positional or keyword, by schema name)."""
    names = [a.name for a in node.target._schema.arguments]
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in new.items():
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _refresh(node: fx.Node) -> fx.Node:
    """Set ``node``'s per-rank fake value from its inputs' (the fake mode of any input tensor)."""
    vals: List[Any] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: vals.extend(pytree.tree_leaves(_val(a))))
    fake = next((v for v in vals if hasattr(v, "fake_mode")), None)
    if fake is None:
        return node
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: _as_fake(_val(a), fake.fake_mode))
    fn = getattr(args[0], node.target) if node.op == "call_method" else node.target
    call_args = args[1:] if node.op == "call_method" else args
    with fake.fake_mode, enable_python_dispatcher():
        node.meta["val"] = fn(*call_args, **kwargs)
    node.meta["example_value"] = node.meta["val"]
    return node


def _as_fake(v: Any, mode: Any) -> Any:
    if isinstance(v, torch.Tensor) and not hasattr(v, "fake_mode"):
        return mode.from_tensor(v, static_shapes=True)
    return v
