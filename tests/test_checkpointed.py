"""Activation checkpointing in every form users write, under ring_cp: context-parallel and exact.

Each form wraps every block of the example Llama (examples/models.py, unchanged) the way its
users do: ``torch.utils.checkpoint`` with ``use_reentrant=False`` and ``True``, torchtitan's
``checkpoint_wrapper`` per block, selective AC (``create_selective_checkpoint_contexts`` with an
op policy saving the matmuls), and ``torch.compiler.nested_compile_region``. Dynamo keeps each
region as a higher-order op with a body; ring_cp opens it (passes/regions.py). Required (every
form and Hugging Face gradient checkpointing on 2 ranks; torchtitan's full and selective AC on 4):
loss and every gradient within 1e-5 of one process running the model eagerly; every
attention became the ring; ``cp-compile explain`` says what the runtime did (its record lists the
regions); and one training step runs the ring forward once per attention, never again in the
backward's recomputation (the ring's output and logsumexp are saved), while the region's other
ops are recomputed (checkpointing still saves memory).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from checks import AttentionCount, explain_record, grad_errors, loss_through_ring_cp, rel, ring_mismatches
from examples.models import llama_factory

TOL = 1e-5
LAYERS = 2


class Checkpoint(nn.Module):
    """``torch.utils.checkpoint.checkpoint(block, ...)`` around one block."""

    def __init__(self, block: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, *args, **self.kwargs)


class NestedRegion(nn.Module):
    """The block's forward as a ``torch.compiler.nested_compile_region``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    @torch.compiler.nested_compile_region
    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.block(*args)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's op-level SAC in small: keep matmul outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(form: str, block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if form == "checkpoint_wrapper":
        return checkpoint_wrapper(block)
    if form == "nested_compile_region":
        return NestedRegion(block)
    if form == "selective":
        return Checkpoint(block, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
    return Checkpoint(block, use_reentrant=form == "reentrant")


def _model(form: str) -> tuple:
    model, inputs = llama_factory(seq_len=32, n_layers=LAYERS)
    model.layers = nn.ModuleList(_wrap(form, b) for b in model.layers)
    return model, inputs


@contextlib.contextmanager
def _ring_calls_and_graphs() -> Iterator[Dict[str, Any]]:
    """Within: count this process's ring forward calls (the op's body) and keep AOTAutograd's
    forward and backward graphs as the aot_eager hand-off schedules them."""
    import cp_compile.backend.compiler as compiler
    import cp_compile.ring.ops as ops

    seen: Dict[str, Any] = {"ring": 0, "graphs": []}
    forward, schedule = ops.ring_forward, compiler.schedule_collectives

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen["ring"] += 1
        return forward(*args, **kwargs)

    def kept(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        seen["graphs"].append(gm)
        return schedule(gm)

    ops.ring_forward, compiler.schedule_collectives = counted, kept
    try:
        yield seen
    finally:
        ops.ring_forward, compiler.schedule_collectives = forward, schedule


def _count(gm: torch.fx.GraphModule, op: Any) -> int:
    return sum(n.target is op for n in gm.graph.nodes)


def _run(form: str) -> Dict[str, Any]:
    import cp_compile  # noqa: F401 (torch.ops.cp_compile)

    (ref_model, inputs), (cp_model, _) = _model(form), _model(form)
    with _ring_calls_and_graphs() as seen:
        ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs)
    fw, bw = seen["graphs"]
    ring, mm, rsqrt = (torch.ops.cp_compile.ring_attention_fwd.default, torch.ops.aten.mm.default,
                       torch.ops.aten.rsqrt.default)
    return {"loss": abs(out.item() - ref.item()) / abs(ref.item()), "grads": grad_errors(cp_model, ref_model),
            "fallbacks": backend.fallbacks, "regions": [r for rec in backend.records for r in rec.regions],
            "ring_calls": seen["ring"], "rings": (_count(fw, ring), _count(bw, ring)),
            "mm": (_count(fw, mm), _count(bw, mm)), "rsqrt": (_count(fw, rsqrt), _count(bw, rsqrt))}


FORMS = ["non_reentrant", "reentrant", "checkpoint_wrapper", "selective", "nested_compile_region"]


# Every form on 2 ranks; on 4, torchtitan's two (full AC per block, op-level selective AC).
CASES = [(form, 2) for form in FORMS] + [("checkpoint_wrapper", 4), ("selective", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("form, world", CASES, ids=[f"{f}-{w}" for f, w in CASES])
def test_checkpointed_blocks_are_context_parallel_and_exact(ranks, form: str, world: int) -> None:
    for rank, r in enumerate(ranks.run(world, _run, form, timeout=300)):
        assert r["loss"] <= TOL, (rank, r["loss"])
        assert not (bad := {k: e for k, e in r["grads"].items() if e > TOL}), (rank, bad)
        assert not r["fallbacks"], (rank, r["fallbacks"])
        assert len(r["regions"]) == LAYERS, (rank, r["regions"])
        assert r["ring_calls"] == LAYERS and r["rings"] == (LAYERS, 0), (rank, r["ring_calls"], r["rings"])
        (fw_mm, bw_mm), (_, bw_rsqrt) = r["mm"], r["rsqrt"]
        if form == "nested_compile_region":  # not checkpointed: nothing recomputed
            assert bw_rsqrt == 0 and bw_mm == 2 * fw_mm, (rank, r["mm"], r["rsqrt"])
        elif form == "selective":  # the policy's matmuls saved, the rest (RMSNorm's rsqrt) recomputed
            assert bw_rsqrt > 0 and bw_mm == 2 * fw_mm, (rank, r["mm"], r["rsqrt"])
        else:  # the whole region recomputed (its matmuls too), except the ring
            assert bw_rsqrt > 0 and bw_mm > 2 * fw_mm, (rank, r["mm"], r["rsqrt"])


def _run_hf(seq_len: int = 64) -> Dict[str, Any]:
    """Hugging Face Llama with ``gradient_checkpointing_enable()`` in train mode, against one process."""
    import hf_models

    import cp_compile

    ref_model, cp_model = (hf_models.hf_model("llama", use_cache=False) for _ in range(2))  # HF: no cache with GC
    for m in (ref_model, cp_model):
        m.gradient_checkpointing_enable()
        m.train()  # Hugging Face checkpoints only in training (its dropouts are 0 in the tiny config)
    ids, labels = hf_models.hf_tokens(seq_len)
    backend = cp_compile.RingCP(inner="aot_eager")
    with torch._dynamo.config.patch(specialize_float=True):
        explained = explain_record(ref_model, (), {"input_ids": ids, "labels": labels},
                                   world_size=torch.distributed.get_world_size())
        with AttentionCount() as count:
            ref = ref_model(input_ids=ids, labels=labels)
        ref.loss.backward()
        with _ring_calls_and_graphs() as seen:
            out = torch.compile(cp_model, backend=backend, fullgraph=True)(input_ids=ids, labels=labels)
            out.loss.backward()
    assert backend.records == [explained], (backend.records, explained)
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "grads": grad_errors(cp_model, ref_model),
            "rings": ring_mismatches(backend, count.calls), "fallbacks": backend.fallbacks,
            "regions": explained.regions, "ring_calls": seen["ring"], "attentions": count.calls}


@pytest.mark.slow
def test_hugging_face_gradient_checkpointing(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _run_hf, timeout=300)):
        assert r["loss"] <= TOL, (rank, r["loss"])
        assert not (bad := {k: e for k, e in r["grads"].items() if e > TOL}), (rank, bad)
        assert not r["rings"] and not r["fallbacks"], (rank, r["rings"], r["fallbacks"])
        assert len(r["regions"]) == r["attentions"] == r["ring_calls"], (rank, r["regions"], r["ring_calls"])


class _CheckpointInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.a, x, use_reentrant=False)


class _Nested(nn.Module):
    """A checkpointed block inside a nested compile region (which Dynamo 2.13 inlines itself when it
    holds a checkpoint), and a checkpoint inside a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.b = _CheckpointInside(), nn.Linear(8, 8)

    def outer(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.b, checkpoint(torch.sin, x, use_reentrant=False), use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.outer, self.inner(x), use_reentrant=False).sum()


def test_nested_regions_open_fully_and_a_checkpoint_stays_one() -> None:
    """No process group needed: the pass alone, on Dynamo's graph of :class:`_Nested`."""
    from cp_compile.passes.normalize.regions import inline_regions, region_of

    graphs: List[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Nested(), backend=capture, fullgraph=True)(torch.randn(2, 8))
    (gm,) = graphs
    regions = inline_regions(gm)
    hops = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert not hops, hops
    linears = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear]
    kinds = [region_of(n).kind for n in linears]
    assert kinds == ["checkpoint", "checkpoint"], kinds  # the one inside the nested compile region too
    assert region_of(linears[0]) is not region_of(linears[1])
    sin = next(n for n in gm.graph.nodes if n.target is torch.sin)  # a checkpoint inside a checkpoint: the outer one
    assert region_of(sin) is region_of(linears[1]), (region_of(sin), region_of(linears[1]))
    assert sum(r.checkpointed for r in regions) == 2, regions
