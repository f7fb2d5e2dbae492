"""What a rewritten graph costs each rank, read off its nodes: collectives, activation bytes,
and the attention masks the ring ops receive (for ``cp-compile explain``).

Everything here reads the graph the runtime runs (the output of ``rewrite_for_cp``,
with rank 0's fake values in ``meta["val"]``): the ring ops' own calls (their
:class:`cp_compile.ring.call_spec.RingCall`, and the per-rank values of their k, v and mask
tensors, :func:`ring_tensors`), the collectives' own operands. Nothing re-derives what the rewrite decided, so the
report cannot drift from what the backend does (the "one code path" rule).

Byte counts are per rank and per training step (one forward and one backward of
the graph), for ``rotate="p2p"``:

* ring attention, per attention node, with K/V block = 2·B·H_kv·c·D·elem_size from
  the local shapes of the ring op's k and v: forward (N-1) K/V hops; backward (N-1)
  K/V hops plus N hops of the fp32 dK/dV accumulators (2·B·H_kv·c·D·4 bytes); N is the ring's own
  size, N / u for an attention given Ulysses of degree u;
* Ulysses all-to-alls (``seq_to_heads`` / ``heads_to_seq``): the (u-1)/u of each head-sharded tensor
  that leaves the rank, forward (q, k, v, out) and as much backward (dout, dq, dk, dv);
* gradient all-reduces: the payload, i.e. the parameter bytes (a ring all-reduce
  moves about 2(N-1)/N of it per rank);
* forward all-reduces (global loss / reductions), whose backward is an all-reduce too;
* gathers (fallbacks): the bytes of the gathered full-sequence value, all-gathered in
  the forward and reduce-scattered in the backward;
* an explicit attention mask: the bytes its tensor holds (dims broadcast by ``expand``,
  stride 0, hold nothing).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .. import graph_ops
from ..passes.fx_utils import rows_per_query, stored_bytes, to_int  # noqa: F401 (to_int: re-exported)
from ..passes.ring_call import ring_call
from ..ring.call_spec import RING_FWD, RingCall, ring_arguments
from ..ulysses import ops as _ulysses_ops  # noqa: F401 (registers the all-to-all ops read below)

_SEQ_TO_HEADS = torch.ops.cp_compile.seq_to_heads.default
_HEADS_TO_SEQ = torch.ops.cp_compile.heads_to_seq.default

KINDS = ("ring_attention", "shard", "grad_all_reduce", "grad_all_reduce_bucket", "all_reduce_sum", "gather",
         "grad_scale")


@dataclass
class Collective:
    """One kind of collective of a training step, with its count and payload bytes per rank."""

    phase: str  # "forward" | "backward"
    what: str
    count: int
    bytes: int
    detail: str = ""


@dataclass(frozen=True)
class TensorHeld:
    """One tensor operand of a ring op as this rank holds it (its per-rank fake value)."""

    node: str  # the argument's node ("" for a value that is no graph node)
    shape: Optional[Tuple[Any, ...]] = None  # per-rank shape; None: no fake value (size unknown)
    dtype: str = ""
    bytes: int = 0  # bytes the tensor holds (dims broadcast by expand, stride 0, hold nothing)
    nbytes: int = 0  # bytes of its elements
    numel: Any = 0
    per_query: bool = False  # a mask whose rows differ by query (O(S^2 / N)), else one row for every query


@dataclass(frozen=True)
class RingTensors:
    """The tensors of one ring op (:func:`ring_tensors`) that the record, the cost model and explain size."""

    k: Optional[TensorHeld] = None
    v: Optional[TensorHeld] = None
    attn_mask: Optional[TensorHeld] = None
    doc_ids: Optional[TensorHeld] = None
    mask_buffers: Tuple[TensorHeld, ...] = ()
    score_buffers: Tuple[TensorHeld, ...] = ()


@dataclass(frozen=True)
class RingSite:
    """One ring op of a rewritten graph: the attention it replaced, its call, what this rank holds for it."""

    attention: str  # the original attention node's name
    call: RingCall
    tensors: RingTensors
    shared_with: str = ""  # an earlier attention given the very same attn_mask node


def node_kind(node: fx.Node) -> str:
    """Which of KINDS ``node`` is, or "" (index_select shards are told apart by the caller)."""
    if node.op == "call_function":
        t = node.target
        if t is RING_FWD:
            return "ring_attention"
        for fn in (graph_ops.grad_all_reduce, graph_ops.grad_all_reduce_bucket, graph_ops.all_reduce_sum,
                   graph_ops.grad_scale):
            if t is fn:
                return fn.__name__
        if t is graph_ops.gather_seq:
            return "gather"
    return ""


def nbytes(val: Any) -> int:
    """Bytes of a (fake) tensor's elements; 0 for anything else or an unknown size."""
    if isinstance(val, torch.Tensor):
        n = to_int(val.numel())
        return n * val.element_size() if isinstance(n, int) else 0
    return 0


def activation_bytes(gm: fx.GraphModule, key: str, seq_scale: Optional[Tuple[Any, int]] = None) -> int:
    """Bytes of every intermediate tensor (not inputs, parameters, buffers or parameter aliases).

    A view (a result sharing the storage of an input or of an earlier result: an image's patches
    viewed, a transpose, an in-place update) holds no bytes of its own. Counted this way the sum
    over the pieces of a split graph (graph breaks, DDPOptimizer) is the one graph's figure.
    ``seq_scale = (L, k)``: count every tensor as if the symbolic length ``L`` were k times its
    value (under ``inputs="local"`` the traced graph has this rank's length: k = N gives the
    one-device figure)."""
    size = nbytes if seq_scale is None else (lambda v: _scaled_nbytes(v, *seq_scale))
    held = _input_storages(gm, key)  # grows with every result counted
    total = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output") or node_kind(n) in ("grad_all_reduce",
                                                                               "grad_all_reduce_bucket"):
            continue
        storage = _storage(n.meta.get(key))
        if storage is not None and storage in held:
            continue  # a view of something already counted (or of an input)
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and node_kind(n.args[0]) == "grad_all_reduce_bucket":
            continue
        total += size(n.meta.get(key))
        if storage is not None:
            held.add(storage)
    return total


def _storage(val: Any) -> Any:
    """A weak reference to a (fake) tensor's storage, comparable across views; None otherwise."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # a tensor subclass without a storage
        return None


def _input_storages(gm: fx.GraphModule, key: str) -> set:
    """The storages of the graph's inputs and attributes (what views of them alias)."""
    found = {_storage(n.meta.get(key)) for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    return found - {None}


def _scaled_nbytes(val: Any, length: Any, k: int) -> int:
    """:func:`nbytes` with the symbol of ``length`` (a SymInt) taken as k times its hint."""
    if not isinstance(val, torch.Tensor) or not isinstance(length, torch.SymInt):
        return nbytes(val)
    numel = val.numel()
    if not isinstance(numel, torch.SymInt):
        return nbytes(val)
    sym, shape_env = length.node.expr, length.node.shape_env
    known = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val  # renamed in torch 2.13
    values = {s: known[s] for s in numel.node.expr.free_symbols if s in known}
    if sym not in values:
        return nbytes(val)
    values[sym] = values[sym] * k
    try:
        return int(numel.node.expr.xreplace(values)) * val.element_size()
    except (TypeError, ValueError):
        return nbytes(val)


def _val(arg: Any) -> Any:
    """The per-rank fake value of a node argument (None for constants)."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _held(arg: Any) -> TensorHeld:
    """What this rank holds of one tensor argument of a ring op."""
    val, name = _val(arg), arg.name if isinstance(arg, fx.Node) else ""
    if not isinstance(val, torch.Tensor):
        return TensorHeld(name)
    per_query = rows_per_query(val)
    return TensorHeld(name, tuple(to_int(d) for d in val.shape), str(val.dtype).removeprefix("torch."),
                      stored_bytes(val), nbytes(val), to_int(val.numel()), per_query)


def ring_tensors(node: fx.Node) -> RingTensors:
    """What this rank holds of a ring op's k, v and mask tensors, found by argument name
    (:func:`cp_compile.ring.call_spec.ring_arguments`)."""
    a = ring_arguments(node)
    one = {key: None if a[key] is None else _held(a[key]) for key in ("k", "v", "attn_mask", "doc_ids")}
    lists = {key: tuple(_held(b) for b in (a[key] or ()) if b is not None) for key in ("mask_buffers", "score_buffers")}
    return RingTensors(**one, **lists)


def ring_sites(after: fx.GraphModule, attention: List[str]) -> List[RingSite]:
    """Each ring op of ``after``, in graph order: the rewrite emits one ring op per original attention,
    in the original order, so ``attention`` (their names) labels them."""
    rings = [n for n in after.graph.nodes if node_kind(n) == "ring_attention"]
    if len(rings) != len(attention):
        raise AssertionError(f"cp_compile: {len(attention)} attention node(s) but {len(rings)} ring op(s) in the "
                             "rewritten graph; please report this model.")
    out: List[RingSite] = []
    first_user: Dict[str, str] = {}
    for ring, name in zip(rings, attention):
        tensors = ring_tensors(ring)
        mask = tensors.attn_mask.node if tensors.attn_mask is not None else ""
        out.append(RingSite(name, ring_call(ring), tensors, first_user.get(mask, "") if mask else ""))
        if mask:
            first_user.setdefault(mask, name)
    return out


def collectives(after: fx.GraphModule, n_ranks: int, gathers: List[fx.Node]) -> List[Collective]:
    """The collectives of one training step of ``after`` on each of ``n_ranks`` ranks (module docstring)."""
    nodes = list(after.graph.nodes)
    rings = [n for n in nodes if node_kind(n) == "ring_attention"]
    out: List[Collective] = []
    kv, acc = _ring_hops(rings, n_ranks)
    a2a = _all_to_alls(nodes)
    if kv[0]:
        out.append(Collective("forward", "ring K/V send+recv (p2p)", kv[0], kv[1],
                              f"{len(rings)} attention, {kv[0]} hop(s) in all"))
    if a2a[0]:
        out.append(Collective("forward", "all_to_all (Ulysses q, k, v, out)", a2a[0], a2a[1],
                              "sequence <-> head shards; the (u-1)/u of each tensor that leaves the rank"))
    ar = [n for n in nodes if node_kind(n) == "all_reduce_sum"]
    ar_bytes = sum(nbytes(n.meta.get("val")) for n in ar)
    if ar:
        out.append(Collective("forward", "all_reduce (global loss / reductions)", len(ar), ar_bytes))
    g_bytes = sum(nbytes(g.meta.get("val")) for g in gathers)
    if gathers:
        out.append(Collective("forward", "all_gather (fallbacks)", len(gathers), g_bytes,
                              "bytes of the gathered full-sequence values"))
    if kv[0]:
        out.append(Collective("backward", "ring K/V send+recv (p2p)", kv[0], kv[1], f"{len(rings)} attention"))
        out.append(Collective("backward", "ring dK/dV send+recv (fp32)", acc[0], acc[1],
                              f"{len(rings)} attention, {acc[0]} hop(s) in all"))
    if a2a[0]:
        out.append(Collective("backward", "all_to_all (Ulysses dout, dq, dk, dv)", a2a[0], a2a[1]))
    out += _grad_collectives(nodes)
    if ar:
        out.append(Collective("backward", "all_reduce (gradient of the global loss)", len(ar), ar_bytes))
    if gathers:
        out.append(Collective("backward", "reduce_scatter (fallbacks)", len(gathers), g_bytes))
    return out


def _ring_hops(rings: List[fx.Node], n_ranks: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((K/V hops, bytes), (dK/dV hops, bytes)) of the ring ops, each over its own ring: N / u ranks
    for an attention given Ulysses of degree u (:mod:`cp_compile.passes.finalize.strategy`)."""
    kv, acc = [0, 0], [0, 0]
    for r in rings:
        size = n_ranks // max(ring_call(r).ulysses, 1)
        if size < 2:
            continue
        held = ring_tensors(r)
        k, v = held.k or TensorHeld(""), held.v or TensorHeld("")
        kv[0], kv[1] = kv[0] + size - 1, kv[1] + (k.nbytes + v.nbytes) * (size - 1)
        per_acc = (k.numel + v.numel) * 4 if k.shape is not None and v.shape is not None else 0
        acc[0], acc[1] = acc[0] + size, acc[1] + per_acc * size
    return (kv[0], kv[1]), (acc[0], acc[1])


def _all_to_alls(nodes: List[fx.Node]) -> Tuple[int, int]:
    """(count, bytes sent) of the forward's Ulysses all-to-alls (the backward sends as many: each op's
    backward is the other): the head-sharded side's bytes times (u-1)/u."""
    count, sent = 0, 0
    for n in nodes:
        if n.op != "call_function" or n.target not in (_SEQ_TO_HEADS, _HEADS_TO_SEQ):
            continue
        u = n.kwargs["u"]
        side = n.meta.get("val") if n.target is _SEQ_TO_HEADS else _val(n.args[0])
        count, sent = count + 1, sent + nbytes(side) * (u - 1) // u
    return count, sent


def _grad_collectives(nodes: List[fx.Node]) -> List[Collective]:
    """The parameter-gradient all-reduces: one per tensor, and the flat buckets of 1-D parameters."""
    out: List[Collective] = []
    singles = [n for n in nodes if node_kind(n) == "grad_all_reduce"]
    buckets = [n for n in nodes if node_kind(n) == "grad_all_reduce_bucket"]
    if singles:
        out.append(Collective("backward", "grad all_reduce (parameters)", len(singles),
                              sum(nbytes(n.meta.get("val")) for n in singles), "one per tensor"))
    if buckets:
        b = sum(nbytes(_val(x)) for n in buckets for x in n.args[0])
        out.append(Collective("backward", "grad all_reduce (1-D parameter buckets)", len(buckets), b,
                              f"{sum(len(n.args[0]) for n in buckets)} tensors flattened"))
    return out
