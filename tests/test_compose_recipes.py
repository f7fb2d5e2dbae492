"""Training recipes around ring_cp on a DP x CP mesh: gradient accumulation and FSDP2 mixed precision.

Gradient accumulation: several micro-batches per optimizer step with DDP ``no_sync()`` and FSDP2
``set_requires_gradient_sync(False)`` on every micro-batch but the last, in both ``grad_sync``
modes, on (dp, cp) = (1, 2) and (2, 2): every micro-batch's loss, the accumulated gradients and
the parameters after one SGD step equal one process running the model eagerly on the same
global micro-batches (fp32, 1e-5 relative). FSDP2 with ``MixedPrecisionPolicy(bf16, fp32)``: the
loss and every gradient no further from the fp32 truth than twice the error of the same FSDP2
policy on one rank, plus 1e-3. The recipes' wrapping is shared with tests/test_compose.py
(tests/compose_kit.py); docs/composing.md explains why each is exact.
"""

from __future__ import annotations

from typing import Any, ContextManager, Tuple

import pytest
import torch
import torch.distributed as dist

import models

from checks import rel
from compose_kit import LR, full, grads_then_step, graph_counts, mean_over_ranks, wrap

TOL = 1e-5
PER_LAYER = ("fsdp_per_layer", "fsdp_dp_allreduce")  # FSDP's hooks split the graph at each layer


MICRO = 3  # micro-batches per optimizer step; the wrappers synchronise on the last one only
ACCUMULATE = ["ddp", "ddp_dp_allreduce", "fsdp_hsdp", "fsdp_dp_allreduce"]  # both grad_sync modes, DDP and FSDP2


def _micro_batch(m: int, rows: int, vocab: int = 256, seq_len: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``m``: (ids, pre-shifted targets), ``rows`` rows (one per dp rank), the same
    targets ignored (-100) in every row, so that the mean of the rows' means is the global mean."""
    g = torch.Generator().manual_seed(1000 + m)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)  # (rows, S)
    ignore = torch.rand(1, seq_len, generator=g) < 0.1  # (1, S)
    return ids, torch.cat([ids[:, 1:], ids[:, :1]], dim=1).masked_fill(ignore, -100)


def _accumulate_reference(dp: int) -> tuple:
    """One process, eager, the unmodified Llama: ``(loss_m / MICRO).backward()`` on each global
    micro-batch, then one SGD step. ([loss per micro-batch], {name: grad}, {name: param after SGD})."""
    model, _ = models.llama_factory(seq_len=32, batch=dp)
    losses = []
    for m in range(MICRO):
        loss = model(*_micro_batch(m, dp))
        (loss / MICRO).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sync_on(recipe: str, run, model, sync: bool) -> ContextManager:
    """The context a micro-batch runs in: DDP's ``no_sync()`` unless ``sync``; FSDP2's
    ``set_requires_gradient_sync(sync)`` (on every FSDP unit: it recurses)."""
    from contextlib import nullcontext

    if recipe.startswith("ddp"):
        return nullcontext() if sync else run.no_sync()
    model.set_requires_gradient_sync(sync)
    return nullcontext()


def _accumulate(recipes: list, dp: int) -> dict:
    """On every rank of a (dp, cp) mesh, per recipe: ([loss per micro-batch, mean over dp],
    {name: full grad after MICRO micro-batches}, {name: full param after SGD}, graph counts)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, dist.get_world_size() // dp), mesh_dim_names=("dp", "cp"))
    d = mesh.get_local_rank("dp")
    out = {}
    for recipe in recipes:
        torch._dynamo.reset()
        model, _ = models.llama_factory(seq_len=32, batch=dp)
        run, backend = wrap(recipe, model, mesh)
        losses = []
        with torch._dynamo.config.patch(optimize_ddp=False):
            for m in range(MICRO):
                ids, labels = _micro_batch(m, dp)
                with _sync_on(recipe, run, model, sync=m == MICRO - 1):
                    loss = run(ids[d : d + 1], labels[d : d + 1])  # this dp rank's row, whole
                    (loss / MICRO).backward()
                losses.append(mean_over_ranks(loss))
        grads, params = grads_then_step(model)
        attentions = 1 if recipe in PER_LAYER else len(model.layers)
        out[recipe] = (losses, grads, params, graph_counts(backend, attentions))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2)], ids=["N2_dp1_cp2", "N4_dp2_cp2"])
def test_gradient_accumulation_with_no_sync_equals_one_process(ranks, dp, cp):
    """MICRO micro-batches per step, the DP wrapper's reduction skipped on all but the last (DDP
    ``no_sync()``, FSDP2 ``set_requires_gradient_sync(False)``). grad_sync="allreduce": ring_cp's sum
    over cp runs in every backward, on that micro-batch's gradient, before autograd accumulates it.
    grad_sync="none": each rank accumulates its CP share; the final synced reduction sums the
    accumulated shares. Either way: every micro-batch's loss, the accumulated gradients and the
    parameters after the step are the one-process run's on the same global micro-batches."""
    ref_losses, ref_grads, ref_params = _accumulate_reference(dp)
    for rank, per_recipe in enumerate(ranks.run(dp * cp, _accumulate, ACCUMULATE, dp, timeout=300)):
        for recipe, (losses, grads, params, counts) in per_recipe.items():
            where = (rank, recipe)
            assert max(rel(a, b) for a, b in zip(losses, ref_losses)) <= TOL, (where, losses, ref_losses)
            assert set(grads) == set(ref_grads), where
            grad_err = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}
            assert max(grad_err.values()) <= TOL, (where, grad_err)
            param_err = {n: rel(params[n], ref_params[n]) for n in ref_params}
            assert max(param_err.values()) <= TOL, (where, param_err)
            assert counts["rewritten"] >= 1 and not counts["ring_mismatches"], (where, counts)


# ---------- FSDP2 mixed precision: bf16 parameters, fp32 gradient reduction

MIXED = ["fsdp_hsdp", "fsdp_dp_allreduce"]  # grad_sync="none" (HSDP over dp x cp), "allreduce" (FSDP over dp)
SLACK = 1e-3  # ring_cp's error may exceed twice the one-process error by this much


def _bf16_policy() -> Any:
    """FSDP2's MixedPrecisionPolicy under test: bf16 compute parameters, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _gpt2(dp: int) -> torch.nn.Module:
    """The example GPT-2 (learned positions: every op computes in the parameters' dtype; the example
    Llama's float32 RoPE tables would promote q and k to float32 against a bf16 v, which SDPA refuses
    eagerly too)."""
    return models.gpt2_factory(seq_len=32, batch=dp)[0]


def _one_process_mixed(dp: int) -> tuple:
    """The same-precision reference: GPT-2 under FSDP2 with the same policy on a mesh of this rank
    alone, eager, the whole global batch. (loss, {name: grad}), fp32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    alone, _ = dist.new_subgroups(group_size=1)  # collective: every rank makes every 1-rank group
    model = _gpt2(dp)
    fully_shard(model, mesh=DeviceMesh.from_group(alone, "cpu"), mp_policy=_bf16_policy())
    loss = model(*_micro_batch(0, dp))
    loss.backward()
    return loss.detach().float(), {n: full(p.grad).clone() for n, p in model.named_parameters()}


def _mixed(recipes: list, dp: int) -> dict:
    """On every rank of a (dp, cp) mesh: {"one process": :func:`_one_process_mixed`, recipe: (loss
    averaged over dp, {name: full grad}, graph counts)} with FSDP2's bf16 policy and ring_cp."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {"one process": _one_process_mixed(dp)}
    mesh = init_device_mesh("cpu", (dp, dist.get_world_size() // dp), mesh_dim_names=("dp", "cp"))
    d = mesh.get_local_rank("dp")
    ids, labels = _micro_batch(0, dp)
    for recipe in recipes:
        torch._dynamo.reset()
        model = _gpt2(dp)
        run, backend = wrap(recipe, model, mesh, _bf16_policy())
        loss = run(ids[d : d + 1], labels[d : d + 1])
        loss.backward()
        grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
        attentions = 1 if recipe in PER_LAYER else len(model.h)
        out[recipe] = (mean_over_ranks(loss), grads, graph_counts(backend, attentions))
    return out


def _fp32_truth(dp: int) -> tuple:
    """One process, eager, the unmodified fp32 GPT-2 on the global batch: (loss, {name: grad})."""
    model = _gpt2(dp)
    loss = model(*_micro_batch(0, dp))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _errors(loss: torch.Tensor, grads: dict, truth: tuple) -> dict:
    """Relative error of the loss and of every gradient against the fp32 truth."""
    true_loss, true_grads = truth
    return {"loss": rel(loss, true_loss), **{n: rel(grads[n], g) for n, g in true_grads.items()}}


@pytest.mark.slow
@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2)], ids=["N2_dp1_cp2", "N4_dp2_cp2"])
def test_fsdp_bf16_mixed_precision_within_twice_the_one_process_error(ranks, dp, cp):
    """FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with ring_cp on the (dp, cp)
    mesh: the loss and every gradient no further from the fp32 truth than twice the same model under
    FSDP2 with the same policy on one rank (+ SLACK). The one-process run must itself be visibly bf16."""
    truth = _fp32_truth(dp)
    for rank, per_recipe in enumerate(ranks.run(dp * cp, _mixed, MIXED, dp, timeout=300)):
        one = _errors(*per_recipe["one process"], truth)
        assert max(one.values()) > 1e-3, (rank, "the one-process run is not bf16", one)
        for recipe in MIXED:
            loss, grads, counts = per_recipe[recipe]
            errs = _errors(loss, grads, truth)
            worse = {k: (e, one[k]) for k, e in errs.items() if not e <= 2 * one[k] + SLACK}
            assert not worse, (rank, recipe, "ring_cp error, one-process error:", worse)
            assert counts["rewritten"] >= 1 and not counts["ring_mismatches"], (rank, recipe, counts)
