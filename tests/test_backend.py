"""The ring_cp backend on real example models: loss and every parameter gradient equal
the single-process run on the full sequence.

Each rank builds the model twice from one seed: one copy runs eagerly on the full
sequence (the single-device reference, identical on every rank), the other is
compiled with ring_cp and runs context-parallel. Tiny models, fp32, aot_eager. What the
backend records of a model is what ``cp-compile explain`` prints (across a graph break: of
the graph with attention). Changing and symbolic lengths: tests/test_backend_dynamic.py.
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
from checks import (AttentionCount, example_through_ring_cp, explain_record, grad_errors,  # noqa: E402
                    loss_and_grad_errors, rel, ring_mismatches)
from cp_compile.passes.context import CPRewriteError  # noqa: E402

TOL = 1e-5


CASES = [
    ("llama_factory", {}, {}),
    ("llama_factory", {"gqa_mode": "repeat_interleave", "rope_style": "slice", "tie_embeddings": True}, {}),
    ("llama_factory", {"gqa_mode": "expand"}, {"load_balance": "striped"}),
    ("llama_factory", {}, {"load_balance": "contiguous", "rotate": "allgather"}),
    ("gpt2_factory", {}, {}),
    ("encoder_factory", {}, {}),  # S == hidden size == 64: the sequence dim is found by trial
    ("encoder_factory", {"pos_style": "learned"}, {"seq_inputs": {"x": 1}}),
]


@pytest.mark.parametrize("factory,kw,options", CASES)
def test_model_loss_and_grads_match_single_device(ranks, factory, kw, options):
    per_rank = ranks.run(2, example_through_ring_cp, factory, kw, options)
    for rank, (loss_err, grad_err, fallbacks, summary) in enumerate(per_rank):
        assert loss_err <= TOL and grad_err <= TOL, (rank, loss_err, grad_err)
        assert fallbacks == 0 and summary["gather_seq"] == 0, (rank, summary)
        assert summary["ring_attention_fwd"] == 2, summary  # both layers' attention became the ring


def _kv_heads_on_the_ring(gqa_mode: str):
    torch._dynamo.reset()
    model, inputs = models.llama_factory(gqa_mode=gqa_mode)
    explained = explain_record(model, inputs, world_size=dist.get_world_size())
    backend = cp_compile.RingCP(inner="aot_eager")
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    return [n.args[1].meta["example_value"].shape[1] if "example_value" in n.args[1].meta else None
            for gm in backend.graphs for n in gm.graph.nodes if "ring_attention_fwd" in str(n.target)]


@pytest.mark.slow
@pytest.mark.parametrize("gqa_mode", ["enable_gqa", "repeat_interleave", "expand"])
def test_gqa_ships_only_the_kv_heads(ranks, gqa_mode):
    """Whatever way the model repeats K/V heads, the ring carries H_kv = 2 heads, not H = 4."""
    for heads in ranks.run(2, _kv_heads_on_the_ring, gqa_mode):
        assert heads == [2, 2], heads


@pytest.mark.slow
def test_llama_on_four_ranks(ranks):
    for loss_err, grad_err, fallbacks, summary in ranks.run(4, example_through_ring_cp, "llama_factory", {}, {}):
        assert loss_err <= TOL and grad_err <= TOL and fallbacks == 0
        # one all-reduce per matrix (per layer wq wk wv wo w1 w2 w3; tok_emb, lm_head) and one bucket
        # for the five 1-D norm scales
        assert summary["grad_all_reduce"] == 2 * 7 + 2 and summary["grad_all_reduce_bucket"] == 1
        assert summary["all_reduce_sum"] == 2  # loss sum and valid-label count, nothing else


@pytest.mark.slow
def test_label_shift_inside_model_is_exact_without_a_gather(ranks):
    """logits[:, :-1] against labels[:, 1:]: the loss runs on the whole logits with the labels
    padded by ignore_index (passes/loss_shift.py), so nothing is gathered (tests/test_zoo_shift.py)."""
    per_rank = ranks.run(2, example_through_ring_cp, "llama_factory", {"shift_labels_inside": True}, {})
    for loss_err, grad_err, fallbacks, summary in per_rank:
        assert loss_err <= TOL and grad_err <= TOL
        assert fallbacks == 0 and summary["gather_seq"] == 0


class _RunningSum(torch.nn.Module):
    """Tokens mixed outside attention: a running sum over the sequence (gathered under
    ``load_balance="striped"``, which holds no contiguous runs to scan: rules/scans.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).cumsum(dim=1)  # (B, S, 16)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, 2, S, 8) each
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def _strict_error():
    torch._dynamo.reset()
    model = _RunningSum()
    try:
        backend = cp_compile.RingCP(inner="aot_eager", strict=True, load_balance="striped")
        torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, 32, (2, 16)))
    except Exception as e:  # Dynamo wraps backend errors
        return f"{type(e).__name__}: {e}"
    return None


def test_strict_refuses_token_mixing_with_op_and_source_line(ranks):
    for msg in ranks.run(2, _strict_error):
        assert msg is not None and "cumsum" in msg
        assert "test_backend.py:" in msg and ".cumsum(dim=1)" in msg and "strict=True" in msg


def _grad_sync_none():
    torch._dynamo.reset()
    ref_model, inputs = models.llama_factory()
    cp_model, _ = models.llama_factory()
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size(), grad_sync="none")
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager", grad_sync="none")
    torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs).backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    shares = grad_errors(cp_model, ref_model)  # a share only: must differ from the full gradient
    for p in cp_model.parameters():
        dist.all_reduce(p.grad)  # what DDP/FSDP would do over the CP ranks
    return shares, grad_errors(cp_model, ref_model), ring_mismatches(backend, count.calls)


@pytest.mark.slow
def test_grad_sync_none_leaves_shares_that_sum_to_the_gradient(ranks):
    for shares, summed, rings in ranks.run(2, _grad_sync_none):
        assert max(summed.values()) <= TOL and not rings, (summed, rings)
        assert max(shares.values()) > 1e-2  # the backend really left the sum out


def _train(steps: int):
    torch._dynamo.reset()
    ref_model, inputs = models.llama_factory()
    cp_model, _ = models.llama_factory()
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size())
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp_model, backend=backend, fullgraph=True)
    opt_ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt_cp = torch.optim.AdamW(cp_model.parameters(), lr=1e-2)
    losses = []
    with torch.no_grad(), AttentionCount() as count:  # the attention calls of one forward
        ref_model(*inputs)
    for _ in range(steps):
        for model, opt in ((ref_model, opt_ref), (compiled, opt_cp)):
            loss = model(*inputs)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert backend.records == [explained], (backend.records, explained)  # one graph, the one explain shows
    param_err = max(rel(p, q) for p, q in zip(cp_model.parameters(), ref_model.parameters()))
    return losses[0::2], losses[1::2], param_err, ring_mismatches(backend, count.calls)


@pytest.mark.slow
def test_twenty_adamw_steps_track_single_device(ranks):
    for ref, cp, param_err, rings in ranks.run(2, _train, 20):
        assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(ref, cp)), list(zip(ref, cp))
        assert ref[-1] < ref[0]  # it did train
        assert param_err <= 1e-4 and not rings, (param_err, rings)


@pytest.mark.slow
def test_without_process_group_the_backend_is_a_passthrough():
    """In the pytest process (no torch.distributed): backend='ring_cp' by name, unchanged numbers;
    a RingCP object with the same options neither rewrites nor records a graph (so there is
    nothing for explain's record to equal)."""
    torch._dynamo.reset()
    model, inputs = models.llama_factory()
    ref = model(*inputs)
    out = torch.compile(model, backend="ring_cp", options={"inner": "aot_eager"})(*inputs)
    assert torch.allclose(out, ref, rtol=1e-6, atol=0)
    torch._dynamo.reset()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(model, backend=backend)(*inputs)
    assert torch.allclose(out, ref, rtol=1e-6, atol=0)
    assert backend.records == [] and backend.graphs == [], backend.records


def test_bad_options_name_the_choices():
    with pytest.raises(ValueError, match="'allreduce', 'none'"):
        cp_compile.RingCP(grad_sync="sometimes")
    with pytest.raises(ValueError, match="'inductor', 'aot_eager', 'eager'"):
        cp_compile.RingCP(inner="tvm")
    with pytest.raises(TypeError):
        cp_compile.RingCP(no_such_option=1)
    assert issubclass(CPRewriteError, RuntimeError)


def _graph_break():
    torch._dynamo.reset()
    ref_model, inputs = models.llama_factory(graph_break_between_layers=True)
    cp_model, _ = models.llama_factory(graph_break_between_layers=True)
    # explain traces one graph (it refuses graph breaks): that of the first layer, the only graph with attention
    ids, pos = inputs[0], torch.arange(inputs[0].shape[1])
    layer_inputs = (ref_model.tok_emb(ids), ref_model.rope_cos[pos], ref_model.rope_sin[pos])  # what a layer takes
    explained = explain_record(ref_model.layers[0], layer_inputs, world_size=dist.get_world_size())
    with AttentionCount() as count:  # of one layer: the frame compiled once and reused by every layer
        ref_model.layers[0](*layer_inputs)
    ref = ref_model(*inputs)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend)(*inputs)
    out.backward()
    assert [r for r in backend.records if r.attention] == [explained], (backend.records, explained)
    assert all(r.rings == 0 for r in backend.records if not r.attention), backend.records
    return (*loss_and_grad_errors(ref_model, ref, cp_model, out), len(backend.graphs), len(backend.no_attention),
            ring_mismatches(backend, count.calls))


@pytest.mark.slow
def test_graph_break_between_layers_stays_exact(ranks):
    """Each compiled piece is rewritten on its own; hidden states cross the breaks full.

    A break inside the layer loop makes Dynamo skip the model's forward frame: each layer's
    frame is compiled on its own (one graph, rewritten once and reused by every layer), and
    the head and loss after the loop make a graph without attention."""
    for loss_err, grad_err, rewritten, plain, rings in ranks.run(2, _graph_break):
        assert rewritten >= 1 and rewritten + plain >= 2, (rewritten, plain)  # the break really split the model
        assert loss_err <= TOL and grad_err <= TOL and not rings, (loss_err, grad_err, rings)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,factory,kw",
    [
        (2, "llama_factory", {"seq_len": 61}),  # causal: padding at the end is never visible
        (4, "llama_factory", {"seq_len": 50, "shift_labels_inside": True}),  # padding + a label shift inside
        (2, "encoder_factory", {"seq_len": 30}),  # non-causal: padded keys must be masked out
        (4, "gpt2_factory", {"seq_len": 37}),
    ],
)
def test_any_sequence_length_is_padded_and_exact(ranks, world, factory, kw):
    for loss_err, grad_err, _fallbacks, summary in ranks.run(world, example_through_ring_cp, factory, kw, {}):
        assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)
        assert summary["ring_attention_fwd"] == 2


def _padded_all_labels_valid(seq_len: int):
    """Every label valid (the last one too), so padding rows would count if not masked."""
    torch._dynamo.reset()
    ref_model, (ids, _) = models.llama_factory(seq_len=seq_len)
    cp_model, _ = models.llama_factory(seq_len=seq_len)
    labels = torch.roll(ids, -1, dims=1)
    explained = explain_record(ref_model, (ids, labels), world_size=dist.get_world_size())
    with AttentionCount() as count:
        ref = ref_model(ids, labels)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(ids, labels)
    out.backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    return (*loss_and_grad_errors(ref_model, ref, cp_model, out), ring_mismatches(backend, count.calls))


@pytest.mark.slow
def test_padding_rows_never_count_in_the_loss(ranks):
    for loss_err, grad_err, rings in ranks.run(2, _padded_all_labels_valid, 62):
        assert loss_err <= TOL and grad_err <= TOL and not rings, (loss_err, grad_err, rings)


def _meta_shapes():
    torch._dynamo.reset()
    model, inputs = models.llama_factory(seq_len=50)
    explained = explain_record(model, inputs, world_size=dist.get_world_size())
    backend = cp_compile.RingCP(inner="aot_eager")
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    (gm,) = backend.graphs
    ring = [n for n in gm.graph.nodes if "ring_attention_fwd" in str(n.target)]
    q = ring[0].args[0]
    from cp_compile.passes.node_facts import facts

    return tuple(q.meta["val"].shape), tuple(facts(q).global_val.shape)


@pytest.mark.slow
def test_rewritten_graph_metadata_holds_local_and_global_shapes(ranks):
    """S=50 pads to 52 on 2 ranks: each holds 26 tokens; q is (B, H, 26, D) locally, (B, H, 50, D) globally."""
    for local, global_ in ranks.run(2, _meta_shapes):
        assert local == (2, 4, 26, 16) and global_ == (2, 4, 50, 16)


@pytest.mark.slow
def test_backend_name_resolves_without_importing_cp_compile():
    """The torch_dynamo_backends entry point: a fresh interpreter that never imports cp_compile."""
    import subprocess

    code = ("import torch, sys; f = torch.compile(lambda x: x * 2, backend='ring_cp', options={'inner': 'eager'}); "
            "assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0)); "
            "assert 'cp_compile' in sys.modules, 'backend not loaded through the entry point'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def _count_ring_exchanges():
    from unittest import mock

    from cp_compile.ring import comm

    torch._dynamo.reset()
    model, inputs = models.llama_factory()
    explained = explain_record(model, inputs, world_size=dist.get_world_size())
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(*inputs).backward()  # compile outside the count
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    real = comm._ring_exchange
    with mock.patch.object(comm, "_ring_exchange", side_effect=real) as spy:
        compiled(*inputs).backward()
    return [call.args[3] for call in spy.call_args_list]  # the tags: K/V hops vs dK/dV hops


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_step_issues_exactly_the_expected_ring_transfers(ranks, world):
    """Per attention layer: N-1 K/V hops forward, N-1 K/V hops + N dK/dV hops backward."""
    from cp_compile.ring.comm import GRAD_TAG, KV_TAG

    for tags in ranks.run(world, _count_ring_exchanges):
        layers = 2
        assert tags.count(KV_TAG) == layers * 2 * (world - 1), tags
        assert tags.count(GRAD_TAG) == layers * world, tags
        assert len(tags) == layers * (3 * world - 2)


class _DropoutOnPositions(torch.nn.Module):
    """Dropout on a whole-sequence value (the position table): every rank would draw its own mask."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = torch.nn.Embedding(64, 16)

    def forward(self, x):  # x: (B, H, S, D)
        pe = torch.nn.functional.dropout(self.wpe(torch.arange(x.shape[2])), 0.1, self.training)  # (S, D)
        q = x + pe
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def _random_global(training: bool):
    torch._dynamo.reset()
    torch.manual_seed(0)  # the same weights on every rank, as CP requires
    model = _DropoutOnPositions().train(training)
    x = torch.randn(2, 2, 32, 16, generator=torch.Generator().manual_seed(0))  # same full batch on every rank
    # in training mode the rewrite refuses the model (the test checks the error), so nothing to compare
    explained = None if training else explain_record(model, (x,), world_size=dist.get_world_size())
    backend = cp_compile.RingCP(inner="aot_eager")
    try:
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    except Exception as e:  # Dynamo wraps backend errors
        return f"{type(e).__name__}: {e}"
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    with AttentionCount() as count:
        ref = model(x)
    return rel(out.detach(), ref.detach()), ring_mismatches(backend, count.calls)


def test_random_ops_on_whole_sequence_values_are_refused(ranks):
    for msg in ranks.run(2, _random_global, True):
        assert isinstance(msg, str) and "dropout" in msg and "test_backend.py" in msg and "eval mode" in msg, msg
    for res in ranks.run(2, _random_global, False):  # eval mode: dropout is the identity, fine
        assert isinstance(res, tuple) and res[0] <= TOL and not res[1], res
