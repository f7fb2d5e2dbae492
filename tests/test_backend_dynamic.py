"""The ring_cp backend when the sequence length changes or is symbolic: every length is exact.

As tests/test_backend.py (each rank builds the model twice from one seed, runs one copy
eagerly on the full sequence and the other compiled with ring_cp, aot_eager, fp32), for
models compiled with ``dynamic=True`` or fed several lengths in one process: a graph per
length (static), a symbolic graph serving padded and unpadded lengths (automatic and
dynamic shapes), symbolic lengths through other models, outputs gathered or left local
under both, and ``inputs="local"`` (a data loader that shards), which needs a symbolic length.
Every compiled graph's record is the one ``cp-compile explain`` prints for that length
and dynamic setting.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp_compile
import models
from checks import AttentionCount, explain_record, layout_mismatches, loss_and_grad_errors, rel, ring_mismatches

TOL = 1e-5


def _outputs(mode: str, dynamic):
    torch._dynamo.reset()
    model, (ids, _labels) = models.llama_factory()
    with AttentionCount() as count:
        ref = model(ids).detach()
    explained = explain_record(model, (ids,), world_size=dist.get_world_size(), dynamic=bool(dynamic), outputs=mode)
    backend = cp_compile.RingCP(inner="aot_eager", outputs=mode)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    out = compiled(ids)
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    want = ref if mode == "full" else cp_compile.shard(ref, 1)
    return (rel(out.detach(), want), tuple(out.shape), layout_mismatches(out, want),
            ring_mismatches(backend, count.calls))


@pytest.mark.slow
@pytest.mark.parametrize("mode,dynamic", [("full", None), ("local", None), ("local", True)],
                         ids=["full-static", "local-static", "local-dynamic"])
def test_outputs_full_and_local(ranks, mode, dynamic):
    """Values, shapes and strides: the gathered logits are laid out as the uncompiled model's.
    (Full outputs of a symbolic graph: test_changing_sequence_lengths_stay_exact, at every length.)"""
    for rank, (err, shape, mismatches, rings) in enumerate(ranks.run(2, _outputs, mode, dynamic)):
        assert err <= TOL and not rings, (rank, err, rings)
        assert shape == ((2, 64, 256) if mode == "full" else (2, 32, 256))
        assert not mismatches, (rank, mismatches)


LENGTHS = (32, 45, 60)
# per dynamic setting: (length, symbolic) of each graph compiled over LENGTHS, in order. Static: one
# per length; automatic: static at the first, then Dynamo makes S symbolic; dynamic: symbolic at once
GRAPHS = {False: [(n, False) for n in LENGTHS], None: [(32, False), (45, True)], True: [(32, True)]}


def _lengths(dynamic):
    torch._dynamo.reset()
    ref_model, _ = models.llama_factory()
    cp_model, _ = models.llama_factory()
    explained = [explain_record(ref_model, models.llama_factory(seq_len=n, seed=n)[1], world_size=dist.get_world_size(),
                                dynamic=symbolic) for n, symbolic in GRAPHS[dynamic]]  # Dynamo reset: before compiling
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp_model, backend=backend, dynamic=dynamic)
    errs, layouts = [], []
    for seq_len in LENGTHS:
        _, inputs = models.llama_factory(seq_len=seq_len, seed=seq_len)
        try:
            with AttentionCount() as count:
                ref = ref_model(*inputs)
            out = compiled(*inputs)
        except Exception as e:  # Dynamo wraps backend errors
            return f"{type(e).__name__}: {e}"
        errs.append(rel(out.detach(), ref.detach()))
        layouts += layout_mismatches(out, ref)  # the full logits, laid out as the uncompiled model's
    assert backend.records == explained, (backend.records, explained)  # each graph: explain at its length
    return errs, layouts, len(backend.graphs), ring_mismatches(backend, count.calls, compiles=len(GRAPHS[dynamic]))


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, None, True], ids=["static", "automatic", "dynamic"])
def test_changing_sequence_lengths_stay_exact(ranks, dynamic):
    """Static: one graph per length. Automatic (the default): Dynamo makes S symbolic at the
    second length. Dynamic: symbolic from the start. Of the lengths 32, 45, 60, 45 needs padding
    at N=2 and the others do not, so one symbolic graph must serve both kinds. The full outputs
    have the uncompiled model's shapes and strides at every length."""
    for res in ranks.run(2, _lengths, dynamic):
        assert isinstance(res, tuple), res
        errs, layouts, n_graphs, rings = res
        assert max(errs) <= TOL and not rings and not layouts, (errs, rings, layouts)  # every graph: the ring
        if dynamic is False:
            assert n_graphs == 3, n_graphs
        else:  # a symbolic graph served several lengths, padded and unpadded
            assert n_graphs <= 2, n_graphs


def _compare_dynamic(factory: str, kw: dict):
    torch._dynamo.reset()
    ref_model, inputs = getattr(models, factory)(**kw)
    cp_model, _ = getattr(models, factory)(**kw)
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size(), dynamic=True)
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend, dynamic=True)(*inputs)
    out.backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    return (*loss_and_grad_errors(ref_model, ref, cp_model, out), ring_mismatches(backend, count.calls))


@pytest.mark.slow
@pytest.mark.parametrize(
    "factory,kw",
    [("gpt2_factory", {"seq_len": 37}), ("encoder_factory", {"seq_len": 30}),
     ("llama_factory", {"seq_len": 50, "shift_labels_inside": True, "gqa_mode": "expand"})],
)
def test_dynamic_shapes_on_other_models(ranks, factory, kw):
    """Symbolic S through absolute positions, non-causal padding masks, a label shift inside the model."""
    for loss_err, grad_err, rings in ranks.run(2, _compare_dynamic, factory, kw):
        assert loss_err <= TOL and grad_err <= TOL and not rings, (loss_err, grad_err, rings)


def _local_inputs(dynamic):
    """Every rank passes only its own shard of the batch (a data loader that calls cp_compile.shard)."""
    torch._dynamo.reset()
    ref_model, (ids, labels) = models.llama_factory()
    cp_model, _ = models.llama_factory()
    local = (cp_compile.shard(ids, 1), cp_compile.shard(labels, 1))
    # static shapes: the backend refuses inputs="local" (the test checks the error), so nothing to compare
    explained = explain_record(ref_model, local, world_size=dist.get_world_size(), dynamic=True,
                               inputs="local") if dynamic else None
    with AttentionCount() as count:
        ref = ref_model(ids, labels)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", inputs="local")
    try:
        out = torch.compile(cp_model, backend=backend, dynamic=dynamic)(*local)
    except Exception as e:  # Dynamo wraps backend errors
        return f"{type(e).__name__}: {e}"
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    assert backend.records[0].sharded_fraction >= 0.9, backend.records  # the llama holds nearly all sharded
    out.backward()
    return (*loss_and_grad_errors(ref_model, ref, cp_model, out), ring_mismatches(backend, count.calls))


@pytest.mark.slow
def test_local_inputs_with_a_symbolic_length_are_exact(ranks):
    for res in ranks.run(2, _local_inputs, True):
        assert isinstance(res, tuple), res
        assert res[0] <= TOL and res[1] <= TOL and not res[2], res


def test_local_inputs_with_static_shapes_name_the_fix(ranks):
    for msg in ranks.run(2, _local_inputs, False):
        assert isinstance(msg, str) and "dynamic=True" in msg and "inputs='local'" in msg, msg


@pytest.mark.slow
def test_local_length_specialized_under_dynamic_names_the_cause() -> None:
    """inputs="local" always traces dynamic, yet a local length equal to the head dim (16) shares its
    symbol (duck sizing) and becomes that constant: the error says so, not just "use dynamic=True".
    (A Llama block compiled on its own with S = 32 on 2 ranks; S = 48, local 24, traces symbolic.)"""
    from cp_compile.errors import CPRewriteError
    from cp_compile.tools.explain import explain_model

    model, _ = models.llama_factory(seq_len=32)
    block, head_dim = model.layers[0], model.cfg.dim // model.cfg.n_heads
    for local in (head_dim, head_dim + 8):
        args = (torch.randn(2, local, model.cfg.dim), model.rope_cos[:local], model.rope_sin[:local])
        if local != head_dim:
            assert explain_model(block, args, world_size=2, inputs="local", outputs="local").ctx.record.rings == 1
            continue
        with pytest.raises(CPRewriteError) as err:
            explain_model(block, args, world_size=2, inputs="local", outputs="local")
        assert f"static local length {local}" in str(err.value) and "duck sizing" in str(err.value), err.value


def _marked_local_block():
    """A Llama block on this rank's shards, each shard's sequence dim marked dynamic on its own."""
    torch._dynamo.reset()
    model, _ = models.llama_factory(seq_len=48)
    block, seq = model.layers[0], 48
    x = torch.randn(2, seq, model.cfg.dim, requires_grad=True)
    whole = (x, model.rope_cos[:seq], model.rope_sin[:seq])
    ref = block(*whole)
    ref.backward(torch.ones_like(ref))
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    local = [cp_compile.shard(t, 1 if t is x else 0).detach().requires_grad_(t is x) for t in whole]
    for t, dim in zip(local, (1, 0, 0)):
        torch._dynamo.mark_dynamic(t, dim)  # x's and cos's/sin's lengths: two symbols, one S
    backend = cp_compile.RingCP(inner="aot_eager", inputs="local", outputs="local")
    out = torch.compile(block, backend=backend, fullgraph=True)(*local)
    out.backward(torch.ones_like(out))
    errs = [rel(out.detach(), cp_compile.shard(ref.detach(), 1)), rel(local[0].grad, cp_compile.shard(x.grad, 1))]
    return errs + [rel(p.grad, ref_grads[n]) for n, p in block.named_parameters()], ring_mismatches(backend, 1)


def test_local_inputs_with_a_symbol_per_marked_input_are_exact(ranks):
    """mark_dynamic gives each input's sequence dim its own symbol; a broadcast unifies them, and the
    graph keeps a placeholder per symbol: every one must read as the whole length N x c (before the fix
    only the first did, and the view of the other, c / N rows, failed to trace)."""
    for errs, rings in ranks.run(2, _marked_local_block):
        assert max(errs) <= TOL and not rings, (errs, rings)
