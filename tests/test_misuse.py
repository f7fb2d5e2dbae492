"""Misuse of the ring op and the backend: clear errors on every rank, never a hang.

Covered elsewhere, not repeated here: tensor checks (q/k batch, head dim, heads,
dtypes, devices of q/k/v among themselves), unknown options and kernels, an
explicit group without torch.distributed, a mesh without a 'cp' dim for
``ring_attention`` (tests/test_ring_errors.py); changing sequence lengths, static,
automatic and ``dynamic=True`` (tests/test_backend.py); peers that die or raise
(tests/test_faults.py).

Here: ranks that pass different shapes or options (caught by the first call's
metadata all-gather, the same error on every rank, the group still usable after);
inputs on a device the group's backend cannot move; the backend with a mesh without
a 'cp' dim or without a process group; float64 on the Triton kernel; the ``timeout``
option's validation; ``torch.compile``'s own ``fullgraph=`` / ``mode=`` /
``options=`` combined with ours; ``outputs='local'`` across a graph break (refused:
the next graph would take a shard for the whole sequence), and the layer code such a
model recompiles under automatic dynamic shapes (``reshape(x.size())``); a nested
(jagged) batch (refused: its attention would run eagerly, unsplit); dropout on a value
every rank holds whole (refused in training: the ranks would draw different masks).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import models

import cp_compile
from cp_compile.backend import compiler as backend_mod
from cp_compile.kernels import get_kernel
from checks import AttentionCount, explain_record, rel, ring_mismatches

MISMATCH = "the ranks of the CP group called the ring op with different arguments"


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message go back to the parent
        return type(e).__name__, str(e)
    return None


def _local(c: int, seed: int, h: int = 4, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, c, d, generator=g) for n in (h, hkv, hkv))


def _ring_mismatches_rank_fn():
    """Each case differs between rank 0 and rank 1; every rank must raise the same error."""
    r = dist.get_rank()
    out = {}
    ring = cp_compile.ring_attention
    out["length"] = _catch(lambda: ring(*_local(8 if r == 0 else 4, 0)))
    out["heads"] = _catch(lambda: ring(*_local(8, 1, h=4 if r == 0 else 2)))
    out["causal"] = _catch(lambda: ring(*_local(8, 2), causal=r == 1))
    out["rotate"] = _catch(lambda: ring(*_local(8, 3), rotate="p2p" if r == 0 else "allgather"))
    out["scale"] = _catch(lambda: ring(*_local(8, 4), scale=0.25 if r == 0 else 0.5))
    out["dtype"] = _catch(lambda: ring(*(t.to(torch.float32 if r == 0 else torch.bfloat16) for t in _local(8, 5))))
    # a device the gloo group cannot move (the reference kernel would take it)
    out["meta"] = _catch(lambda: ring(*(t.to("meta") for t in _local(8, 6)), kernel="reference"))
    # the group still works, and agreeing ranks pass the check
    q, k, v = _local(8, 7)
    out["after"] = ring(q, k, v, causal=True)
    out["after_again"] = ring(q, k, v, causal=True)
    return out


def test_ranks_with_different_arguments_all_raise(ranks):
    expected = {
        "length": "q shape: rank 0 (1, 4, 8, 16), rank 1 (1, 4, 4, 16)",
        "heads": "q shape: rank 0 (1, 4, 8, 16), rank 1 (1, 2, 8, 16)",
        "causal": "causal: rank 0 False, rank 1 True",
        "rotate": "rotate: rank 0 p2p, rank 1 allgather",
        "scale": "scale: rank 0 0.25, rank 1 0.5",
        "dtype": "dtype: rank 0 torch.float32, rank 1 torch.bfloat16",
    }
    results = ranks.run(2, _ring_mismatches_rank_fn, timeout=120)
    for rank, res in enumerate(results):
        for case, fragment in expected.items():
            assert res[case] is not None, f"rank {rank}: {case} mismatch not detected"
            typ, msg = res[case]
            assert typ == "ValueError" and MISMATCH in msg and fragment in msg, (rank, case, msg)
            assert "Fix: every rank must pass its own shard of the same global sequence" in msg, msg
        typ, msg = res["meta"]
        assert typ == "ValueError" and "q, k, v are on meta but the CP group's backend ('gloo')" in msg, msg
        assert "Fix: move q, k, v to cpu or cuda" in msg, msg
        assert res["after"].shape == (1, 4, 8, 16) and torch.equal(res["after"], res["after_again"])


def _compiled_mismatch_rank_fn():
    """The ring_cp backend where rank 1 passes a longer sequence than rank 0: the batch check
    (check_batch, the default) refuses it before the graph runs; without it, the ring op's own
    check of its arguments does."""
    seq_len = 32 if dist.get_rank() == 0 else 48
    model, inputs = models.llama_factory(seq_len=seq_len)
    checked = torch.compile(model, backend=cp_compile.RingCP(inner="aot_eager"), fullgraph=True)
    batch = _catch(lambda: checked(*inputs))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=cp_compile.RingCP(inner="aot_eager", check_batch=False), fullgraph=True)
    first = _catch(lambda: compiled(*inputs))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch._dynamo.reset()
    no_cp = _catch(lambda: torch.compile(model, backend=cp_compile.RingCP(mesh=mesh, inner="aot_eager"))(*inputs))
    return batch, first, no_cp


@pytest.mark.slow
def test_compiled_model_with_different_lengths_per_rank(ranks):
    for rank, (batch, first, no_cp) in enumerate(ranks.run(2, _compiled_mismatch_rank_fn, timeout=180)):
        assert batch is not None and batch[0] == "BatchMismatchError", (rank, batch)
        assert "'input_ids' (ranks [1] differ from rank 0 in shapes rank 0 (2, 32), rank 1 (2, 48))" in batch[1], batch
        assert first is not None, f"rank {rank}: different lengths not detected"
        typ, msg = first
        assert typ == "ValueError" and MISMATCH in msg, (rank, msg)
        assert "q shape: rank 0 (2, 4, 16, 16), rank 1 (2, 4, 24, 16)" in msg, msg
        assert "every rank passes the same full batch" in msg, msg
        assert no_cp is not None and "none named 'cp'" in no_cp[1] and "Fix: pass mesh['cp']" in no_cp[1], no_cp


# --------------------------------------------------------------------------- single process


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not (dist.is_available() and dist.is_initialized()), "the pytest process must not init a group"


@pytest.mark.slow
def test_backend_group_without_process_group():
    torch._dynamo.reset()
    model, inputs = models.llama_factory(seq_len=16)
    compiled = torch.compile(model, backend=cp_compile.RingCP(mesh=object(), inner="eager"))
    with pytest.raises(Exception, match="torch.distributed is not initialised") as info:
        compiled(*inputs)
    assert "init_process_group" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_timeout_must_be_positive_seconds(bad):
    q, k, v = _local(8, 0)
    for make in (lambda: cp_compile.ring_attention(q, k, v, timeout=bad), lambda: cp_compile.RingCP(timeout=bad),
                 lambda: cp_compile.RingOptions(timeout=bad)):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds or None"):
            make()
    assert cp_compile.RingOptions(timeout=30).timeout == 30


def test_float64_on_the_triton_kernel_is_refused():
    q, k, v = (t.double() for t in _local(8, 0))
    for call in (lambda: get_kernel("triton", q.device, torch.float64),
                 lambda: cp_compile.ring_attention(q, k, v, kernel="triton")):
        with pytest.raises(ValueError, match="kernel 'triton'") as info:
            call()
        assert "torch.float64" in str(info.value) and "Fix:" in str(info.value)


def test_fullgraph_with_a_graph_break_is_dynamos_error():
    torch._dynamo.reset()
    model, inputs = models.llama_factory(seq_len=16, graph_break_between_layers=True)
    compiled = torch.compile(model, backend="ring_cp", options={"inner": "eager"}, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(*inputs)


def test_mode_goes_to_the_inner_inductor():
    seen = {}

    def fake_inductor(gm, example_inputs, **kwargs):
        seen.update(kwargs)
        return lambda *args: args

    wrapped = backend_mod._with_mode(fake_inductor, "inductor", "max-autotune-no-cudagraphs")
    wrapped(None, [], config_patches={"reorder_for_compute_comm_overlap": True})
    assert seen["config_patches"] == {
        "max_autotune": True, "coordinate_descent_tuning": True, "reorder_for_compute_comm_overlap": True,
    }
    assert backend_mod._with_mode(fake_inductor, "inductor", "default") is fake_inductor
    with pytest.raises(RuntimeError, match="Unrecognized mode=fastest"):
        backend_mod._with_mode(fake_inductor, "inductor", "fastest")


@pytest.mark.slow
def test_mode_and_options_with_a_ringcp_object(caplog):
    """torch.compile passes mode=/options= to a backend object: RingCP takes both."""
    torch._dynamo.reset()
    model, inputs = models.llama_factory(seq_len=16)
    ref = model(*inputs)
    with caplog.at_level(logging.WARNING, logger="cp_compile"):
        out = torch.compile(model, backend=cp_compile.RingCP(inner="aot_eager"), mode="reduce-overhead")(*inputs)
    assert torch.allclose(out, ref, rtol=1e-6, atol=0)
    assert "mode='reduce-overhead' is an Inductor setting; inner='aot_eager' ignores it" in caplog.text
    torch._dynamo.reset()
    out = torch.compile(model, backend=cp_compile.RingCP(inner="inductor"), options={"inner": "eager"})(*inputs)
    assert torch.allclose(out, ref, rtol=1e-6, atol=0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown ring_cp options \\['innr'\\]"):
        torch.compile(model, backend=cp_compile.RingCP(), options={"innr": "eager"})(*inputs)
    with pytest.raises(RuntimeError, match="Either mode or options can be specified"):
        torch.compile(model, backend="ring_cp", mode="max-autotune", options={"inner": "eager"})


class _Attention(torch.nn.Module):
    """x + causal self-attention over x (B, S, 16); nothing in it depends on the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)  # (B, 2, S, 8)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return x + out.transpose(1, 2).reshape(x.shape)


class _TwoAttentions(torch.nn.Module):
    """Two attention layers with a graph break between them: Dynamo compiles each layer's
    forward as a graph of its own, and the hidden state crosses from one to the next."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Attention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            torch._dynamo.graph_break()
        return x


def _local_outputs_across_a_graph_break(guard: bool):
    """outputs='local' on a model Dynamo splits between two attentions; ``guard=False`` runs it
    with the guard switched off, to show what it prevents (returns the error, or the error of
    the output against this rank's shard of the single-device output)."""
    import contextlib
    from unittest import mock

    torch._dynamo.reset()
    model, x = _TwoAttentions(), torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1))  # c = 32
    ref = cp_compile.shard(model(x).detach(), 1)
    backend = cp_compile.RingCP(inner="aot_eager", outputs="local")
    patch = mock.patch.object(backend_mod, "guard_local_shards", lambda compiled, *_: compiled)
    with contextlib.nullcontext() if guard else patch:
        try:
            out = torch.compile(model, backend=backend)(x)
        except Exception as e:  # noqa: BLE001 - the error is what is checked
            return f"{type(e).__name__}: {e}"
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, this rank's shard is {tuple(ref.shape)}"
    return ((out.detach() - ref).norm() / ref.norm()).item()


def test_local_outputs_across_a_graph_break_are_refused(ranks):
    """The second graph would take this rank's shard for the whole sequence and split it again
    (unguarded: the output is silently wrong), so it is refused."""
    for unguarded in ranks.run(2, _local_outputs_across_a_graph_break, False):
        assert not isinstance(unguarded, float) or unguarded > 1e-2, unguarded
    for msg in ranks.run(2, _local_outputs_across_a_graph_break, True):
        assert isinstance(msg, str) and "outputs='local'" in msg and "graph break" in msg and "Fix:" in msg, msg


def _dynamic_reshape_to_size():
    """``y.reshape(x.shape)`` under dynamic shapes: Dynamo emits ``x.size()`` as a graph value."""
    backend = cp_compile.RingCP(inner="aot_eager")
    layer = _Attention()
    explained = explain_record(layer, (torch.randn(2, 64, 16),), world_size=dist.get_world_size(), dynamic=True)
    compiled = torch.compile(layer, backend=backend, dynamic=True)
    errs = []
    for s in (64, 48):
        x = torch.randn(2, s, 16, generator=torch.Generator().manual_seed(s))
        with AttentionCount() as count:
            ref = layer(x)
        errs.append(rel(compiled(x), ref))
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    return max(errs), len(backend.fallbacks), len(backend.graphs), ring_mismatches(backend, count.calls)


def test_reshape_to_a_sharded_size_under_dynamic_shapes(ranks):
    """``x.size()`` of a sharded value is its global size (S along the sequence), and the view
    makes it local again: exact, one graph for two lengths, nothing gathered."""
    for err, fallbacks, graphs, rings in ranks.run(2, _dynamic_reshape_to_size):
        assert err <= 1e-5 and fallbacks == 0 and graphs == 1 and not rings, (err, fallbacks, graphs, rings)


class _JaggedAttention(torch.nn.Module):
    """Self-attention over a jagged batch x (B, j, 16): the torch.nested way to skip padding."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (2, 8)).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, 2, j, 8)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).flatten(-2)


def _jagged_batch():
    torch.manual_seed(0)
    model = _JaggedAttention()
    x = torch.nested.nested_tensor([torch.randn(5, 16), torch.randn(7, 16)], layout=torch.jagged)
    eager = model(x)  # torch runs it (the math kernel): only ring_cp has something to refuse
    try:
        torch.compile(model, backend=cp_compile.RingCP(inner="aot_eager"))(x)
    except Exception as e:  # noqa: BLE001 - Dynamo wraps backend errors
        return eager.is_nested, str(e)
    return eager.is_nested, None


def test_nested_jagged_inputs_are_refused_naming_the_input_and_the_fix(ranks):
    """Dynamo cannot trace attention on jagged tensors and would run it eagerly, unsplit on every
    rank; ring_cp sees the jagged projections and refuses them."""
    for eager_ok, msg in ranks.run(2, _jagged_batch):
        assert eager_ok, "eager attention on the jagged batch failed: the check below would test nothing"
        assert msg is not None, "a jagged batch compiled silently (attention unsplit on every rank)"
        assert "input 'x' is a nested (jagged) tensor" in msg and "test_misuse.py:" in msg, msg
        assert "Fix: pad the batch to a dense (B, S) tensor" in msg, msg


class _DropoutOnAWholeValue(torch.nn.Module):
    """Attention over x plus a learned (S, D) table that dropout reads whole on every rank."""

    def __init__(self, seq: int, dim: int, spelling: str, p: float) -> None:
        super().__init__()
        self.table, self.spelling, self.p = torch.nn.Parameter(torch.randn(seq, dim)), spelling, p

    def forward(self, x):  # x (B, S, D)
        if self.spelling == "torch.dropout":
            noisy = torch.dropout(self.table, self.p, self.training)
        else:
            noisy = torch.nn.functional.dropout(self.table, p=self.p, training=self.training)
        q = (x + noisy.sum(0)).unsqueeze(1)  # (B, 1, S, D): the table's sum over S is whole on every rank
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


@pytest.mark.parametrize("spelling", ["F.dropout", "torch.dropout"])
def test_dropout_on_a_whole_value_is_refused_in_training_only(spelling):
    from cp_compile.errors import CPRewriteError
    from cp_compile.tools.explain import explain_model

    x = torch.randn(2, 8, 16)
    with pytest.raises(CPRewriteError, match=r"dropout at .*test_misuse.py.* draws random numbers.*Fix"):
        explain_model(_DropoutOnAWholeValue(8, 16, spelling, 0.1), (x,), world_size=2)
    for p, training in ((0.0, True), (0.1, False)):  # nothing random is drawn: rewritten
        model = _DropoutOnAWholeValue(8, 16, spelling, p).train(training)
        assert explain_model(model, (x,), world_size=2).ctx.record.rings == 1
