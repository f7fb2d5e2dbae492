"""Shared pieces of the DP x CP composition tests (tests/test_compose*.py): how each recipe wraps
the example model (FSDP2, HSDP, DDP, per-layer FSDP) around ring_cp, and how a step's gradients
and loss are read back on every rank. Not a test module: the tests import it."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cp_compile
from checks import ring_mismatches

LR = 0.1  # the SGD step every composition test takes


def _sum_then_divide(state, bucket):
    """DDP comm hook: all-reduce SUM of the bucket over ``group``, divided by ``factor``
    (DDP's default hook divides by the group size)."""
    group, factor = state
    buf = bucket.buffer().div_(factor)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def blocks(model) -> torch.nn.ModuleList:
    """The transformer blocks of an example model (Llama's ``layers``, GPT-2's ``h``)."""
    return model.layers if hasattr(model, "layers") else model.h


def wrap(recipe: str, model, mesh, mp_policy=None, **options):
    """Apply ``recipe`` to ``model``; returns (the callable to run, the RingCP backend).
    ``mp_policy``: FSDP2's MixedPrecisionPolicy for the FSDP recipes (None: FSDP2's default);
    ``options``: more RingCP options (e.g. ``strategy``)."""
    sync = "allreduce" if recipe.endswith("allreduce") else "none"
    backend = cp_compile.RingCP(inner="aot_eager", mesh=mesh, grad_sync=sync, **options)  # uses the "cp" dim
    if recipe.startswith("ddp"):
        return _wrap_ddp(recipe, model, mesh, backend), backend
    if not recipe.startswith("fsdp"):
        raise ValueError(recipe)
    _shard_fsdp(recipe, model, mesh, mp_policy, backend)
    per_layer = recipe.startswith("fsdp_per_layer") or recipe == "fsdp_dp_allreduce"  # FSDP's hooks break the graph
    return torch.compile(model, backend=backend, fullgraph=not per_layer), backend


def _shard_fsdp(recipe: str, model, mesh, mp_policy, backend) -> None:
    """Apply FSDP2 to ``model`` as the ``fsdp_*`` recipe says (in place)."""
    from functools import partial

    from torch.distributed.fsdp import fully_shard

    if mp_policy is not None:
        fully_shard = partial(fully_shard, mp_policy=mp_policy)
    if recipe == "fsdp_hsdp":  # replicate over dp, shard over cp; one reduction sums over both
        units, unit_mesh = (model,), mesh
    elif recipe == "fsdp_flat":  # shard over all dp x cp ranks
        units, unit_mesh = (model,), mesh["dp", "cp"]._flatten("dp_cp")
    elif recipe.startswith("fsdp_per_layer"):  # HSDP per layer: FSDP's hooks break the graph
        units, unit_mesh = (*blocks(model), model), mesh
    elif recipe == "fsdp_dp_allreduce":  # per-layer FSDP over dp; ring_cp sums over cp
        for layer in blocks(model):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return
    else:
        raise ValueError(recipe)
    for module in units:
        fully_shard(module, mesh=unit_mesh)
    for module in units:  # these settings act on one unit each
        module.set_gradient_divide_factor(float(mesh.size(0)))  # sum over dp x cp, / dp
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (NCCL does)
    if recipe == "fsdp_per_layer":
        # FSDP's hooks break the graph inside Llama.forward's loop, so Dynamo runs that forward
        # eagerly and compiles only the modules it calls that have Python frames of their own
        # (the layers, RMSNorm): the built-in nn.Embedding and nn.Linear must be compiled too.
        model.tok_emb = torch.compile(model.tok_emb, backend=backend)
        model.lm_head = torch.compile(model.lm_head, backend=backend)


def _wrap_ddp(recipe: str, model, mesh, backend):
    """The ``ddp*`` recipes: compile the inner module (DDP's own forward does not trace), wrap it in DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model.compile(backend=backend, fullgraph=True)
    if recipe == "ddp_dp_allreduce":
        return DDP(model, process_group=mesh.get_group("dp"))
    group = mesh["dp", "cp"]._flatten("dp_cp").get_group()
    ddp = DDP(model, process_group=group, bucket_cap_mb=1 if recipe == "ddp_optimizer" else 25)
    if recipe in ("ddp", "ddp_optimizer"):
        ddp.register_comm_hook((group, float(mesh.size(0))), _sum_then_divide)
    return ddp


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP) gathered whole; a plain tensor (DDP) as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grads_then_step(model) -> tuple:
    """({name: full grad}, {name: full param after one SGD step}) of a wrapped model."""
    named = [(n.replace("._orig_mod", ""), p) for n, p in model.named_parameters()]  # torch.compile'd submodules
    grads = {n: full(p.grad).clone() for n, p in named}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return grads, {n: full(p.detach()).clone() for n, p in named}


def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """Each dp row's loss is on its CP ranks: the mean over all ranks is the mean over dp (fp32)."""
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def graph_counts(backend, attentions: int) -> dict:
    """Graphs ring_cp rewrote, ring attention calls in them, graphs without attention, and what of
    "every attention (``attentions`` in the compiled code) became the ring" fails."""
    rings = sum("ring_attention_fwd" in str(n.target) for gm in backend.graphs for n in gm.graph.nodes)
    return {"rewritten": len(backend.graphs), "rings": rings, "plain": len(backend.no_attention),
            "ring_mismatches": ring_mismatches(backend, attentions)}
