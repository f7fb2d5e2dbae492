"""Checks shared by the tests that compare a ring_cp model with the uncompiled one.

``outputs="full"`` promises what the uncompiled model returns: values, shapes and the
memory layout (strides), since code after a graph break may ``view`` an output. And
``cp-compile explain`` promises what the runtime does: :func:`explain_record` is the
record explain prints, to compare with the backend's ``RingCP.records``.

Exactness is two checks, since a graph compiled unchanged is exact too: every parameter
gradient against the one-process run (:func:`grad_errors`), and every attention of the model,
counted without the code under test (:class:`AttentionCount`), became the ring
(:func:`ring_mismatches`).
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch.utils._pytree import tree_flatten

# What exact means (examples/_exact.py, in examples/ so that examples/zoo/measure.py and
# examples/hf_sweep.py judge by the same rules; re-exported here for the tests): every gradient
# against its own norm, only those named as zero in exact arithmetic against 1e-4 of the whole
# gradient's norm; and every attention of the eager run became the ring.
from _exact import AttentionCount, cp_compile_warnings, grad_errors, rel, ring_mismatches  # noqa: F401 (re-exported)


def layout_mismatches(out: Any, ref: Any) -> List[str]:
    """Each tensor of ``out`` (any nesting of tuples, lists, dicts, ModelOutputs) whose shape or
    strides differ from ``ref``'s tensor at the same place; [] when all agree."""
    outs, ref_leaves = (_tensors(x) for x in (out, ref))
    if len(outs) != len(ref_leaves):
        return [f"{len(outs)} tensors returned, the uncompiled model returns {len(ref_leaves)}"]
    return [f"output {i}: shape {tuple(a.shape)} strides {a.stride()}, uncompiled {tuple(b.shape)} {b.stride()}"
            for i, (a, b) in enumerate(zip(outs, ref_leaves)) if a.shape != b.shape or a.stride() != b.stride()]


def _tensors(tree: Any) -> List[torch.Tensor]:
    if hasattr(tree, "to_tuple"):  # a Hugging Face ModelOutput
        tree = tree.to_tuple()
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def explain_record(model: torch.nn.Module, args: tuple = (), kwargs: Any = None, world_size: int = 2,
                   rank: Any = None, **options: Any) -> Any:
    """The :class:`cp_compile.backend.record.GraphRecord` that ``cp-compile explain --rank R`` prints for
    ``model`` (one graph, traced without a process group; R: this process's rank when a process
    group is up, else 0). Resets Dynamo: call it before compiling."""
    import torch.distributed as dist

    from cp_compile.tools.explain import explain_model

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    return explain_model(model, args, world_size=world_size, example_kwargs=kwargs, rank=rank, **options).ctx.record


def loss_through_ring_cp(ref_model: torch.nn.Module, cp_model: torch.nn.Module, inputs: tuple, **options: Any):
    """On a rank: forward + backward of the scalar loss of ``ref_model`` (eager, whole sequence)
    and of ``cp_model`` (an identical copy) through ring_cp (``inner="aot_eager"``,
    ``fullgraph=True``), after checking that explain's record is the one the runtime keeps and
    that every attention of the eager run (:class:`AttentionCount`) became the ring.
    Returns ``(ref_loss, cp_loss, backend)``."""
    import torch.distributed as dist

    import cp_compile

    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size(), **options)
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", **options)
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    assert not (rings := ring_mismatches(backend, count.calls)), rings
    return ref, out, backend


def pieces_mismatches(records: List[Any], explained: Any) -> List[str]:
    """What of ``explained`` (explain's record of a model traced as one graph, e.g. without its
    graph breaks) the runtime's ``records`` of the same model compiled as several graphs (graph
    breaks, DDPOptimizer's buckets) must show too; [] when all agree. Per graph only the runtime
    knows where a piece starts, so compared: the CP group size, the attention source lines in
    order (node names can differ: DDPOptimizer's pieces rename nodes) with every one the ring,
    the fallbacks and unsplit attention by source line, and the activation bytes on one device
    (the pieces split the one graph's intermediate tensors between them)."""
    import re

    def lines(msgs: List[str]) -> List[str]:  # a finding without the node name it carries
        return [re.sub(r" \(node [^)]*\)", "", m) for m in msgs]

    got = {
        "world_size": sorted({r.world_size for r in records}),
        "attention": [line for r in records for _, line in r.attention],
        "rings": sum(r.rings for r in records),
        "graphs whose attention is not all the ring": [i for i, r in enumerate(records) if r.rings != len(r.attention)],
        "fallbacks": lines([f for r in records for f in r.fallbacks]),
        "unsplit": lines([u for r in records for u in r.unsplit]),
        "act_bytes_global": sum(r.act_bytes_global for r in records),
    }
    want = {
        "world_size": [explained.world_size], "attention": [line for _, line in explained.attention],
        "rings": explained.rings, "graphs whose attention is not all the ring": [],
        "fallbacks": lines(explained.fallbacks), "unsplit": lines(explained.unsplit),
        "act_bytes_global": explained.act_bytes_global,
    }
    return [f"{k}: runtime {got[k]!r}, explain {want[k]!r}" for k in want if got[k] != want[k]]
