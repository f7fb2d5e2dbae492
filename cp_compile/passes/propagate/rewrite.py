"""Sequence-layout propagation and the rewrite it drives, in one walk.

Before: a Dynamo graph on full sequences (``ctx`` filled by the analyses: find_attention,
seq_inputs, seq_origins). After: a new GraphModule that every rank of the CP group runs on its
share of the sequence (the old graph is left as it was):

    input_ids (B, S) ─ index_select(positions) ─> (B, S/N) ── ... ── ring_attention ── ...
    loss = ce_sum_local ─ all_reduce ─ / all_reduce(valid count)          (exact global mean)
    weights ─ grad_all_reduce ─> (identity forward, gradient summed over the group)
    outputs: Sharded ─ gather ─> full; every Global output ─ grad_scale(1/N)

The walk visits the old graph in order and emits a new one. Each value gets a
layout (:mod:`.propagate.placements`); ops whose inputs are all Global are copied unchanged, and
every other op is handled by its rule in :mod:`.rules` (the one table of layout
rules), or gathered to Global by the fallback (warning, or an error under strict).
Propagation and emission share one walk because a rule's conversions (indexing a
Global operand by position, rewriting a baked-in length) are new nodes whose
inputs are the new values; the emitter they use is :mod:`.emitter`.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Tuple

import torch
import torch.fx as fx
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

from ... import graph_ops
from ..context import CPRewriteError, RewriteContext, global_shape, log, source_line
from .doc_table import emit_table
from .emitter import Emitter
from ..fx_utils import drop_empty_vmap_regions, erase_unused
from ..op_vocab import DROPOUT, arguments
from ..analyze.find_attention import is_sdpa
from .rules.vmap import DECREMENT, INCREMENT
from .placements import GLOBAL, Global, Sharded
from ..normalize.regions import stamp_region
from .row_select import select_rows
from .rules.table import apply_rule
from ..analyze.graph_inputs import is_parameter_like, refuse_unknown


BUCKET_BYTES = 1 << 20  # 1-D parameters share one gradient all-reduce up to this size


def _placeholder(em: Emitter, node: fx.Node) -> None:
    """Copy a graph input; what it needs (gradient sync, sharding) waits for :func:`_finish_inputs`."""
    em.env[node], em.layouts[node] = em.copy(node, (), {}), GLOBAL
    em.inputs.append(node)


def _finish_inputs(em: Emitter) -> None:
    """After the last placeholder: gradient sync of the inputs, then sharding of sequence inputs.

    An input that needs a gradient gets ``grad_all_reduce``: its per-rank gradient is
    a share (local positions only, or a replicated use), and the caller (an
    optimizer, eager code before a graph break, or the previous piece of a
    DDPOptimizer split) needs the full gradient. Parameters skip it under
    ``grad_sync="none"`` (DDP/FSDP sums them); see :func:`.seq_inputs.input_kind`. 1-D
    parameters (norm scales, biases) share one flat all-reduce per bucket. Buckets
    are emitted first: autograd runs later-created nodes first, so the per-matrix
    all-reduces fire as their gradients appear and the buckets at the very end.
    """
    ctx = em.ctx
    local = ctx.options.inputs == "local"
    if local:  # the traced length is this rank's c: the whole sequence is N * c (wherever the graph reads it)
        places = em.seq_placeholders()
        whole = em.call(operator.mul, em.env[places[0]], ctx.world)
        for place in places:
            em.env[place] = whole
    bucket, synced = _gradient_syncs(em, local)
    for chunk in _chunks(bucket, lambda n: n.meta["example_value"].numel() * 4):
        outs = em.call(graph_ops.grad_all_reduce_bucket, [em.env[n] for n in chunk], ctx.group.name)
        for i, n in enumerate(chunk):
            em.env[n] = em.call(operator.getitem, outs, i)
    for n in synced:
        em.env[n] = em.call(graph_ops.grad_all_reduce, em.env[n], ctx.group.name)
    for n in em.inputs:
        if n.name in ctx.shard_inputs:
            dim = ctx.shard_inputs[n.name]
            em.env[n] = em.env[n] if local else em.to_sharded(n, dim)
            em.layouts[n] = Sharded(dim)
    em.inputs = []


def _gradient_syncs(em: Emitter, local: bool) -> Tuple[List[fx.Node], List[fx.Node]]:
    """(1-D parameters summed in buckets, other inputs summed one by one) among the inputs that
    need a gradient (see :func:`_finish_inputs`)."""
    ctx, synced, bucket = em.ctx, [], []
    for node in em.inputs:
        example = em.examples.get(node.name)
        if not (isinstance(example, torch.Tensor) and example.requires_grad):
            continue
        if local and node.name in ctx.shard_inputs:
            continue  # a local shard's gradient is already complete on its rank
        refuse_unknown(node, example, ctx)
        is_param = is_parameter_like(node, example)
        if is_param and ctx.options.grad_sync == "allreduce" and example.dim() <= 1:
            bucket.append(node)
        elif not is_param or ctx.options.grad_sync == "allreduce":
            synced.append(node)
    return bucket, synced


def _chunks(items: List[fx.Node], nbytes) -> List[List[fx.Node]]:
    """Consecutive groups of at most BUCKET_BYTES (a larger item stands alone)."""
    out: List[List[fx.Node]] = []
    for item in items:
        if out and sum(map(nbytes, out[-1])) + nbytes(item) <= BUCKET_BYTES:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _output(em: Emitter, node: fx.Node) -> None:
    ctx = em.ctx

    def finish(old: Any) -> Any:
        if not isinstance(old, fx.Node):
            return old
        lay = em.layout(old)
        if isinstance(lay, Sharded) and ctx.options.outputs == "local":
            return em.env[old]
        if isinstance(lay, Sharded):
            shape, ex = global_shape(old), old.meta.get("example_value")
            nbytes = ex.numel() * ex.element_size() if isinstance(ex, torch.Tensor) else 0
            log.info("cp_compile: output %s %s is gathered to the full sequence (%.1f MiB per rank); "
                     "if it crosses a graph break, fullgraph=True avoids this", old.name, tuple(shape), nbytes / 2**20)
        val = _dense_like(em, old, em.to_global(old)) if isinstance(lay, Sharded) else em.env[old]
        if isinstance(lay, (Sharded, Global)) and isinstance(old.meta.get("example_value"), torch.Tensor) \
                and old.meta["example_value"].dtype.is_floating_point:
            val = em.call(graph_ops.grad_scale, val, 1.0 / ctx.world)
        return val

    outs = node.args[0]
    if ctx.options.outputs == "local" and isinstance(outs, (tuple, list)):  # Dynamo's flat output tuple
        ctx.local_outputs = [i for i, o in enumerate(outs) if isinstance(em.layout(o), Sharded)]
    em.graph.output(_map_outputs(outs, finish))


def _dense_like(em: Emitter, old: fx.Node, gathered: fx.Node) -> fx.Node:
    """``gathered`` laid out in memory in the dim order of ``old``'s original output.

    The gather builds the sequence dim outermost, e.g. logits (B, S, V) with strides
    (V, B·V, 1); the uncompiled model returns them contiguous, and code after a graph
    break may ``view`` them (Hugging Face's loss does). ``outputs="full"`` promises what
    the uncompiled model returns, so the output gets the original's stride order (dense:
    a strided view such as ``x[:, ::2]`` comes back as a dense tensor in the same order).
    """
    ex = old.meta.get("example_value")
    if not isinstance(ex, torch.Tensor) or ex.dim() < 2:
        return gathered
    perm, _ = compute_elementwise_output_logical_to_physical_perm(ex)  # outermost dim first
    if list(perm) == list(range(ex.dim())):
        return em.method("contiguous", gathered)
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return em.method("permute", em.method("contiguous", em.method("permute", gathered, perm)), inverse)


def _map_outputs(outs: Any, fn) -> Any:
    if isinstance(outs, (list, tuple)):
        return type(outs)(_map_outputs(o, fn) for o in outs)
    if isinstance(outs, dict):
        return {k: _map_outputs(v, fn) for k, v in outs.items()}
    return fn(outs)


def _tuple_getitem(em: Emitter, node: fx.Node) -> bool:
    if node.target is not operator.getitem:
        return False
    src, idx = node.args
    lay = em.layout(src)
    if isinstance(lay, tuple):  # a rule's tuple of new values (rules/scans.py: cummax) is indexed here
        em.env[node] = em.env[src][idx] if isinstance(em.env[src], tuple) else em.copy(node, (em.env[src], idx), {})
        em.layouts[node] = lay[idx]
        return True
    return False


RANDOM_OPS = {torch.rand, torch.randn, torch.randint, torch.bernoulli, torch.rand_like, torch.randn_like, *DROPOUT}


def _refuse_random_global(node: fx.Node) -> None:
    """A random op on a value every rank holds whole would draw different numbers per rank."""
    if node.op != "call_function" or node.target not in RANDOM_OPS:
        return
    if node.target in DROPOUT:
        a = arguments(node, ("input", "p", "training"))  # torch.dropout names its flag "train"
        if a.get("p", 0.5) == 0 or not a.get("training", a.get("train", True)):
            return
    raise CPRewriteError(
        f"cp_compile: {getattr(node.target, '__name__', node.target)} at {source_line(node)} draws random numbers "
        "for a value that is not split by sequence, so every rank would draw different ones. Fix: apply it to "
        "per-token activations, set its probability to 0, or run the model in eval mode."
    )


def _drop_dead_code(em: Emitter) -> None:
    """Erase every pure op of the rewritten graph whose value nothing reads, and then its inputs.

    The construction of a mask the ring op replaced by its causal flag or a rule (an (S, S)
    ``triu`` of ``generate_square_subsequent_mask``), a whole value only its shard was taken
    of: left in, they would run on every rank and count in the record's bytes and in
    ``cp-compile explain``. In-place and impure ops (random draws, ``_set_grad_enabled``) stay.
    """
    erase_unused(em.graph, list(em.graph.nodes))
    drop_empty_vmap_regions(em.graph)


def _check_every_attention_is_the_ring(em: Emitter) -> None:
    """Post-condition: no attention over the whole sequence survives the rewrite.

    Each SDPA of the old graph became one ring op (on whole q/k/v too: indexed by this rank's
    positions, which costs no communication since every rank holds them), so every rank
    holds only its share of every attention's queries and keys."""
    left = [n for n in em.graph.nodes if is_sdpa(n)]
    rings = sum(n.target is torch.ops.cp_compile.ring_attention_fwd.default for n in em.graph.nodes)
    if left or rings != len(em.ctx.attention):
        where = ", ".join(source_line(n) for n in left) or "?"
        raise CPRewriteError(
            f"cp_compile: the rewrite left {len(left)} scaled_dot_product_attention on the whole sequence "
            f"({where}) and made {rings} ring op(s) of {len(em.ctx.attention)} attention(s). This is a bug in "
            "cp_compile. Fix: report it with the model; strict=False cannot help here."
        )


def _emit(em: Emitter, node: fx.Node) -> None:
    """Emit ``node``: copied as it is when it reads nothing sharded, else by its layout rule."""
    if not em.sharded_inputs(node) and not is_sdpa(node):  # attention on whole q/k/v: the rule indexes them
        _refuse_random_global(node)
        em.env[node] = em.copy(node, *em.value((node.args, node.kwargs)))
        em.layouts[node] = GLOBAL
        if node.name in em.ctx.shard_nodes:  # the sequence arises here (seq_origins): shard it at once
            dim = em.ctx.shard_nodes[node.name]
            em.env[node], em.layouts[node] = select_rows(em, node, dim), Sharded(dim)
    else:
        em.env[node], em.layouts[node] = apply_rule(em, node)


def rewrite_graph(gm: fx.GraphModule, ctx: RewriteContext, examples: Dict[str, torch.Tensor]) -> fx.GraphModule:
    em = Emitter(gm, ctx, examples)
    ids = ctx.document_ids  # load_balance="documents": the ids, moved to the top (normalize/documents_first.py)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            _placeholder(em, node)
            continue
        if ids is not None and em.index.table is None and ids in em.env:
            emit_table(em, ids)  # the layout of this call, before anything is sharded
        if em.inputs and (ids is None or em.index.table is not None):
            _finish_inputs(em)  # all placeholders come first (and, under documents, the ids)
        em.vmap_depth += (node.target is INCREMENT) - (node.target is DECREMENT)  # rules/vmap.py
        if node.op == "output":
            _output(em, node)
        elif node.op == "get_attr":
            em.env[node], em.layouts[node] = em.copy(node, (), {}), GLOBAL
        elif _tuple_getitem(em, node):
            continue
        else:
            with stamp_region(em.graph, node):  # what it emits joins node's checkpointed region
                _emit(em, node)
    _drop_dead_code(em)
    _check_every_attention_is_the_ring(em)
    new_gm = fx.GraphModule(gm, em.graph)
    new_gm.graph.lint()
    log.debug("cp_compile: rewritten graph\n%s", new_gm.code)
    return new_gm
