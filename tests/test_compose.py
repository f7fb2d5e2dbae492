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

Several graphs under ``grad_sync="none"``: two recipes run per-layer
FSDP2 (its hooks split the graph; the embedding and the head graphs have no attention)
and DDP with DDPOptimizer on (Dynamo splits the graph at DDP's 1 MB buckets: a 2.1 MB
Llama with a tied embedding becomes three pieces, the middle one taking the hidden
states and RoPE tables the first computed, the last one the head without attention).
On 2 ranks without data parallelism, graph breaks check the same share contract: the
shares summed over cp (what DDP/FSDP does) equal every parameter's gradient.

Gradient accumulation: 3 micro-batches per SGD step, the DP wrapper's reduction skipped on all but
the last (DDP ``no_sync()``, FSDP2 ``set_requires_gradient_sync(False)``), both grad_sync modes, on
(dp, cp) = (2, 2) and (1, 2): every micro-batch's loss, the accumulated gradients and the parameters
after the step equal one eager process on the same global micro-batches (fp32, 1e-5 relative).
FSDP2 mixed precision (bf16 parameters, fp32 reduction), same meshes, the example GPT-2: the loss and
every gradient no further from the fp32 truth than twice FSDP2 with the same policy on one rank, + 1e-3.

``cp-compile explain`` (tests/checks.py, run on the unwrapped model, the CP group being the
mesh's "cp" dim) must say what the runtime did: its record is the runtime's one record; under
per-layer FSDP, the record of the layer graph (explain of one layer); where Dynamo splits the
one graph explain traces (DDPOptimizer, graph breaks), what explain can know of the pieces.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

import models

import cp_compile
from checks import explain_record, pieces_mismatches, rel, ring_mismatches
from compose_kit import LR, grads_then_step, graph_counts, mean_over_ranks, wrap

DP, CP = 2, 2
TOL = 1e-5
# dim 128, 3 layers, vocab 2048, tied embedding: 2.1 MB of parameters, split by DDPOptimizer
# (bucket_cap_mb=1) into embedding + layer 0 attention | the rest of the layers | head + loss.
SPLIT_MODEL = {"dim": 128, "n_layers": 3, "vocab_size": 2048, "tie_embeddings": True}
PER_LAYER = ("fsdp_per_layer", "fsdp_dp_allreduce")  # FSDP's hooks split the graph at each layer


def _global_batch(**model_kw):
    """The example Llama (``model_kw``: config overrides) and a global batch of DP rows (S=32),
    the same count of valid targets (labels != -100) in every row."""
    model, (ids, labels) = models.llama_factory(seq_len=32, batch=DP, **model_kw)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # pre-shifted, as llama_factory's labels
    return model, ids, targets.masked_fill(labels[:1] == -100, -100)


def _reference(model_kw: dict):
    """Single process, eager, whole global batch: (loss, {name: grad}, {name: param after SGD})."""
    model, ids, labels = _global_batch(**model_kw)
    loss = model(ids, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _compose(recipe: str, model_kw: dict, options: Optional[dict] = None):
    """On every rank: (loss averaged over dp, {name: full grad}, {name: full param after SGD},
    the graph counts of :func:`graph_counts`); ``options``: more RingCP options."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    model, ids, labels = _global_batch(**model_kw)
    d = mesh.get_local_rank("dp")
    ids, labels = ids[d : d + 1], labels[d : d + 1]  # this dp rank's row; both cp ranks pass it whole
    options = options or {}
    explained = None if recipe == "fsdp_per_layer_model" else _explain(recipe, model, ids, labels, mesh, options)
    run, backend = wrap(recipe, model, mesh, **options)
    # DDPOptimizer (Dynamo's default under DDP) splits the graph at DDP bucket boundaries:
    # on only where a recipe tests it.
    with torch._dynamo.config.patch(optimize_ddp=recipe == "ddp_optimizer"):
        loss = run(ids, labels)
        loss.backward()
    _check_records(recipe, backend.records, explained)
    grads, params = grads_then_step(model)
    # one attention a layer; under per-layer FSDP one compiled layer graph serves every layer
    attentions = 1 if recipe in PER_LAYER else len(model.layers)
    return mean_over_ranks(loss), grads, params, graph_counts(backend, attentions)


def _explain(recipe: str, model, ids, labels, mesh, options: dict):
    """What ``cp-compile explain`` says of the model this rank compiles (before it is wrapped, on
    this rank's row; the CP group is the mesh's "cp" dim): the whole model's record, or under
    per-layer FSDP the record of one layer, the graph that holds the attention."""
    options = dict(world_size=CP, rank=mesh.get_local_rank("cp"),
                   grad_sync="allreduce" if recipe.endswith("allreduce") else "none", **options)
    if recipe in PER_LAYER:
        pos = torch.arange(ids.shape[1])
        x, cos, sin = model.tok_emb(ids), model.rope_cos[pos], model.rope_sin[pos]  # what the layers take
        return explain_record(model.layers[0], (x, cos, sin), **options)
    return explain_record(model, (ids, labels), **options)


def _check_records(recipe: str, records: list, explained) -> None:
    """explain's record is the runtime's: of the one graph; under per-layer FSDP, of the layer graph
    (one compiled graph serves every layer; the embedding, norm and head are graphs of their own,
    without attention, that explain cannot trace apart); under DDPOptimizer, what explain can know
    of the pieces Dynamo splits the one graph into (checks.pieces_mismatches)."""
    if recipe in PER_LAYER:
        assert [r for r in records if r.attention] == [explained], (records, explained)
        assert all(r.rings == 0 for r in records if not r.attention), records
    elif recipe == "ddp_optimizer":
        assert not pieces_mismatches(records, explained), (pieces_mismatches(records, explained), records)
    else:
        assert records == [explained], (records, explained)


@pytest.fixture(scope="module")
def reference():
    torch._dynamo.reset()
    return _reference({})


@pytest.fixture(scope="module")
def split_reference():
    torch._dynamo.reset()
    return _reference(SPLIT_MODEL)


def _check(per_rank: list, reference) -> None:
    """Every rank's loss, full gradients and parameters after SGD equal the reference's, and every
    attention became the ring."""
    ref_loss, ref_grads, ref_params = reference
    for rank, (loss, grads, params, counts) in enumerate(per_rank):
        assert rel(loss, ref_loss) <= TOL, (rank, loss.item(), ref_loss.item())
        assert set(grads) == set(ref_grads)
        grad_err = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}
        assert max(grad_err.values()) <= TOL, (rank, grad_err)
        param_err = {n: rel(params[n], ref_params[n]) for n in ref_params}
        assert max(param_err.values()) <= TOL, (rank, param_err)
        assert not counts["ring_mismatches"], (rank, counts)


RECIPES = ["fsdp_hsdp", "fsdp_flat", "ddp", "fsdp_dp_allreduce", "ddp_dp_allreduce"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_dp_x_cp_equals_one_process_on_the_global_batch(ranks, reference, recipe):
    per_rank = ranks.run(4, _compose, recipe, {}, timeout=300)
    for rank, (*_, counts) in enumerate(per_rank):
        assert counts["rewritten"] >= 1, (rank, "ring_cp rewrote no graph")
    _check(per_rank, reference)


@pytest.mark.slow
def test_dp_x_cp_under_ulysses(ranks, reference):
    """Ulysses inside each CP group of a DP x CP mesh: its sub-groups are made by their members only
    (the CP groups are not the world), and DDP's reduction over dp composes with it."""
    per_rank = ranks.run(4, _compose, "ddp", {}, {"strategy": "ulysses"}, timeout=300)
    _check(per_rank, reference)


@pytest.mark.slow
def test_per_layer_fsdp_with_grad_sync_none_equals_one_process(ranks, reference):
    """FSDP's hooks split the model: the graphs without attention (embedding, final norm, head)
    leave their parameters a 1/cp share too, so HSDP's sum over cp is the gradient."""
    per_rank = ranks.run(4, _compose, "fsdp_per_layer", {}, timeout=300)
    for *_, counts in per_rank:
        # one graph serves both layers; embedding, final norm and head are graphs without attention
        assert counts["rewritten"] >= 1 and counts["plain"] >= 3, counts
    _check(per_rank, reference)


@pytest.mark.slow
def test_ddp_optimizer_with_grad_sync_none_equals_one_process(ranks, split_reference):
    """DDPOptimizer on: the pieces' inputs computed by an earlier piece are activations (full
    gradient, sharded where they reach attention), not parameters."""
    per_rank = ranks.run(4, _compose, "ddp_optimizer", SPLIT_MODEL, timeout=300)
    for *_, counts in per_rank:
        # three pieces, one without attention; all three attentions became the ring, so the
        # hidden states the second piece takes were split over cp (not left whole)
        assert counts == {"rewritten": 2, "rings": 3, "plain": 1, "ring_mismatches": []}, counts
    _check(per_rank, split_reference)


@pytest.mark.slow
def test_ddp_default_mean_over_dp_x_cp_halves_the_gradient(ranks, reference):
    """Control: DDP's own hook divides by dp x cp = 4 where dp = 2 is right, so with
    grad_sync="none" every gradient comes out at exactly 1/CP of the true one."""
    _, ref_grads, _ = reference
    for _, grads, *_ in ranks.run(4, _compose, "ddp_default_mean", {}, timeout=300):
        for n, g in grads.items():
            assert rel(g * CP, ref_grads[n]) <= TOL, n


def _refusal(recipe: str) -> str:
    """The error ``recipe`` raises on this rank ("" if none)."""
    try:
        _compose(recipe, {})
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return ""


def test_per_layer_fsdp_with_an_eager_embedding_is_refused(ranks):
    """Control: with only torch.compile(model), per-layer FSDP makes Dynamo run Llama.forward
    eagerly, so nn.Embedding's weight never reaches ring_cp and every cp rank would hold its
    full gradient (cp times too large after the sum): grad_sync="none" refuses, naming the fix."""
    for msg in ranks.run(4, _refusal, "fsdp_per_layer_model", timeout=300):
        assert "runs eagerly" in msg and "EmbeddingBackward0" in msg and "torch.compile(module" in msg, msg


def _graph_break_shares(model_kw: dict):
    """grad_sync="none" across graph breaks: (share err, summed err) per parameter, and the
    number of rewritten graphs and of graphs without attention."""
    ref_model, inputs = models.llama_factory(**model_kw)
    cp_model, _ = models.llama_factory(**model_kw)
    # explain traces one graph and refuses graph breaks (its error: remove them): its record of the
    # model without them is compared with what the runtime's graphs show of it together
    whole, _ = models.llama_factory(**{k: v for k, v in model_kw.items() if not k.startswith("graph_break")})
    explained = explain_record(whole, inputs, world_size=dist.get_world_size(), grad_sync="none")
    ref_model(*inputs).backward()
    backend = cp_compile.RingCP(inner="aot_eager", grad_sync="none")
    torch.compile(cp_model, backend=backend)(*inputs).backward()
    assert not pieces_mismatches(backend.records, explained), (pieces_mismatches(backend.records, explained),
                                                               backend.records)
    errs = {}
    for (name, p), (_, p_ref) in zip(cp_model.named_parameters(), ref_model.named_parameters()):
        share = rel(p.grad, p_ref.grad)
        dist.all_reduce(p.grad)  # what DDP/FSDP does over the CP ranks
        errs[name] = (share, rel(p.grad, p_ref.grad))
    return errs, len(backend.graphs), len(backend.no_attention), ring_mismatches(backend, len(cp_model.layers))


@pytest.mark.slow
@pytest.mark.parametrize("model_kw", [
    # embedding | layers | norm + head + loss: the first and last graphs have no attention
    {"graph_break_after_embedding": True, "graph_break_before_head": True},
    # tied embedding: used in a rewritten graph (embedding + layers) and in one without attention (head)
    {"graph_break_before_head": True, "tie_embeddings": True},
], ids=["embedding_layers_head", "tied_embedding"])
def test_graph_breaks_with_grad_sync_none_leave_shares_that_sum_to_the_gradient(ranks, model_kw):
    """Graphs without attention run whole on every rank: their parameters' gradients are
    scaled to a 1/N share, so the sum over the CP ranks is the gradient (not N times it)."""
    for errs, n_rewritten, n_plain, rings in ranks.run(2, _graph_break_shares, model_kw):
        assert n_rewritten == 1 and n_plain >= 1 and not rings, (n_rewritten, n_plain, rings)
        assert max(after for _, after in errs.values()) <= TOL, errs
        assert min(share for share, _ in errs.values()) > 1e-2, errs  # every gradient was left a share


def _local_inputs_across_a_break() -> str:
    """inputs="local" with a graph break after the embedding: the error (or "")."""
    model, (ids, labels) = models.llama_factory(graph_break_after_embedding=True)
    backend = cp_compile.RingCP(inner="aot_eager", inputs="local")
    try:
        torch.compile(model, backend=backend, dynamic=True)(cp_compile.shard(ids, 1), cp_compile.shard(labels, 1))
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error; its message is checked
        return str(e)
    return ""


def test_local_inputs_with_a_graph_without_attention_are_refused(ranks):
    """The embedding graph cannot tell whether it sees this rank's shard or the whole sequence,
    so whether its parameter gradient is a share (with grad_sync="allreduce" nothing would sum
    it over cp): refused, naming the source line and the fix."""
    for msg in ranks.run(2, _local_inputs_across_a_break):
        assert "graph without attention" in msg and "inputs='full'" in msg and "models.py" in msg, msg


# ---------- gradient accumulation: MICRO micro-batches per optimizer step
