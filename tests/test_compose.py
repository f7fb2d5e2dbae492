"""ring_cp composed with data parallelism (FSDP2 and DDP) on a 2-D DeviceMesh.

4 gloo ranks form ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))``.
The global batch has one row per dp rank: dp rank d takes row d, and both cp ranks
of that dp group pass the row whole (full sequence); ring_cp splits the sequence
over "cp". Every recipe must give, on every rank, the loss (averaged over dp), every
parameter's full gradient and the parameters after one SGD step of a single process
running the unmodified model eagerly on the whole global batch (fp32, 1e-5 relative).

Who reduces what: with ``grad_sync="none"`` each rank's gradient is its CP share
(shares sum over cp to the gradient of its dp row's loss), so one reduction over all
dp x cp ranks must sum and divide by the dp size only; with the default
``grad_sync="allreduce"`` ring_cp sums over cp itself and DDP/FSDP over "dp" takes
the mean as usual. The loss is a mean over valid targets, so every row gets the
same number of valid targets: then the mean of the per-row means is the global mean
(as for data parallelism without CP). Tiny Llama, S=32, aot_eager.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import models  # noqa: E402

import cp_compile  # noqa: E402

DP, CP = 2, 2
TOL = 1e-5
LR = 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _global_batch():
    """The example Llama and a global batch of DP rows (S=32), the same count of valid
    targets (labels != -100) in every row."""
    model, (ids, labels) = models.llama_factory(seq_len=32, batch=DP)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # pre-shifted, as llama_factory's labels
    return model, ids, targets.masked_fill(labels[:1] == -100, -100)


def _reference():
    """Single process, eager, whole global batch: (loss, {name: grad}, {name: param after SGD})."""
    model, ids, labels = _global_batch()
    loss = model(ids, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sum_then_divide(state, bucket):
    """DDP comm hook: all-reduce SUM of the bucket over ``group``, divided by ``factor``
    (DDP's default hook divides by the group size)."""
    group, factor = state
    buf = bucket.buffer().div_(factor)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _wrap(recipe: str, model, mesh):
    """Apply ``recipe`` to ``model``; returns (the callable to run, the RingCP backend)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    sync = "allreduce" if recipe.endswith("allreduce") else "none"
    backend = cp_compile.RingCP(inner="aot_eager", mesh=mesh, grad_sync=sync)  # ring_cp uses the "cp" dim
    if recipe == "fsdp_hsdp":  # replicate over dp, shard over cp; one reduction sums over both
        fully_shard(model, mesh=mesh)
        model.set_gradient_divide_factor(float(mesh.size(0)))  # sum over dp x cp, / dp
        model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (NCCL does)
    elif recipe == "fsdp_flat":  # shard over all dp x cp ranks
        fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
        model.set_gradient_divide_factor(float(mesh.size(0)))
        model.set_force_sum_reduction_for_comms(True)
    elif recipe == "fsdp_dp_allreduce":  # per-layer FSDP over dp; ring_cp sums over cp
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif recipe.startswith("ddp"):  # compile the inner module: DDP's own forward does not trace
        model.compile(backend=backend, fullgraph=True)
        if recipe == "ddp_dp_allreduce":
            return DDP(model, process_group=mesh.get_group("dp")), backend
        group = mesh["dp", "cp"]._flatten("dp_cp").get_group()
        ddp = DDP(model, process_group=group)
        if recipe == "ddp":
            ddp.register_comm_hook((group, float(mesh.size(0))), _sum_then_divide)
        return ddp, backend
    else:
        raise ValueError(recipe)
    return torch.compile(model, backend=backend, fullgraph=recipe != "fsdp_dp_allreduce"), backend


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP) gathered whole; a plain tensor (DDP) as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compose(recipe: str):
    """On every rank: (loss averaged over dp, {name: full grad}, {name: full param after SGD},
    number of graphs ring_cp rewrote)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    model, ids, labels = _global_batch()
    d = mesh.get_local_rank("dp")
    ids, labels = ids[d : d + 1], labels[d : d + 1]  # this dp rank's row; both cp ranks pass it whole
    run, backend = _wrap(recipe, model, mesh)
    # DDPOptimizer would split the graph at DDP bucket boundaries (see the README).
    with torch._dynamo.config.patch(optimize_ddp=False):
        loss = run(ids, labels)
        loss.backward()
    named = list(model.named_parameters())
    grads = {n: _full(p.grad).clone() for n, p in named}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {n: _full(p.detach()).clone() for n, p in named}
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # each dp row's loss is on CP ranks: the mean over all ranks = over dp
    return loss / dist.get_world_size(), grads, params, len(backend.graphs)


@pytest.fixture(scope="module")
def reference():
    torch._dynamo.reset()
    return _reference()


RECIPES = ["fsdp_hsdp", "fsdp_flat", "ddp", "fsdp_dp_allreduce", "ddp_dp_allreduce"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_dp_x_cp_equals_one_process_on_the_global_batch(ranks, reference, recipe):
    ref_loss, ref_grads, ref_params = reference
    for rank, (loss, grads, params, n_graphs) in enumerate(ranks.run(4, _compose, recipe, timeout=300)):
        assert n_graphs >= 1, (rank, "ring_cp rewrote no graph")
        assert _rel(loss, ref_loss) <= TOL, (rank, loss.item(), ref_loss.item())
        assert set(grads) == set(ref_grads)
        grad_err = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
        assert max(grad_err.values()) <= TOL, (rank, grad_err)
        param_err = {n: _rel(params[n], ref_params[n]) for n in ref_params}
        assert max(param_err.values()) <= TOL, (rank, param_err)


def test_ddp_default_mean_over_dp_x_cp_halves_the_gradient(ranks, reference):
    """Control: DDP's own hook divides by dp x cp = 4 where dp = 2 is right, so with
    grad_sync="none" every gradient comes out at exactly 1/CP of the true one."""
    _, ref_grads, _ = reference
    for _, grads, _, _ in ranks.run(4, _compose, "ddp_default_mean", timeout=300):
        for n, g in grads.items():
            assert _rel(g * CP, ref_grads[n]) <= TOL, n
