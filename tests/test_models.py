"""The example models in examples/models.py: they run, their variants agree, the
causal ones are causal, and Dynamo captures each as a single graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import (  # noqa: E402
    encoder_factory,
    gpt2_factory,
    llama_factory,
    shift_labels,
)

FACTORIES = {"llama": llama_factory, "gpt2": gpt2_factory, "encoder": encoder_factory}
TOL = dict(rtol=0, atol=1e-6)


def _loss_and_grads(model: torch.nn.Module, inputs: tuple, fn=None) -> tuple:
    """Loss and parameter gradients of ``fn(*inputs)`` (default: ``model``)."""
    model.zero_grad(set_to_none=True)
    loss = (model if fn is None else fn)(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "encoder"])
def test_forward_backward(name: str) -> None:
    model, inputs = FACTORIES[name](seq_len=32)
    loss, grads = _loss_and_grads(model, inputs)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())
    out = model(inputs[0])  # no labels / targets: per-token outputs
    assert out.shape[:2] == inputs[0].shape[:2]


def test_factories_are_deterministic() -> None:
    (m1, (a1, b1)), (m2, (a2, b2)) = llama_factory(seed=3), llama_factory(seed=3)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    _, (a3, _) = llama_factory(seed=4)
    assert not torch.equal(a1, a3)
    _, (ids, labels) = llama_factory()
    ignored = labels == -100
    assert ignored[:, -1].all() and ignored[:, :-1].any()
    keep = ~ignored[:, :-1]
    assert torch.equal(labels[:, :-1][keep], ids[:, 1:][keep])


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_llama_variants_agree(tie: bool) -> None:
    """gqa_mode and rope_style change only how the same math is written."""
    results = []
    for gqa_mode in ("enable_gqa", "repeat_interleave"):
        for rope_style in ("arange_index", "slice"):
            model, inputs = llama_factory(
                seq_len=48, gqa_mode=gqa_mode, rope_style=rope_style, tie_embeddings=tie
            )
            results.append(_loss_and_grads(model, inputs))
    loss0, grads0 = results[0]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, **TOL)
        for n in grads0:
            torch.testing.assert_close(grads[n], grads0[n], **TOL)


def test_shift_labels_inside_matches_pre_shifted() -> None:
    inside, (ids_a, raw_labels) = llama_factory(seq_len=40, shift_labels_inside=True)
    outside, (ids_b, shifted) = llama_factory(seq_len=40)
    assert torch.equal(ids_a, ids_b)
    assert torch.equal(shift_labels(raw_labels), shifted)
    loss_in, grads_in = _loss_and_grads(inside, (ids_a, raw_labels))
    loss_out, grads_out = _loss_and_grads(outside, (ids_b, shifted))
    torch.testing.assert_close(loss_in, loss_out, **TOL)
    for n in grads_in:
        torch.testing.assert_close(grads_in[n], grads_out[n], **TOL)


@pytest.mark.parametrize(
    "factory,overrides",
    [
        (llama_factory, {}),
        (llama_factory, {"gqa_mode": "repeat_interleave", "rope_style": "slice"}),
        (gpt2_factory, {}),
    ],
)
def test_causal(factory, overrides: dict) -> None:
    S, t = 32, 13
    model, (ids, _) = factory(seq_len=S, **overrides)
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], **TOL)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 0


def test_encoder_is_bidirectional() -> None:
    model, (x, _) = encoder_factory(seq_len=32)
    changed = x.clone()
    changed[:, 20] += 1.0
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert (after[:, :20] - before[:, :20]).abs().amax(dim=-1).min() > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,overrides",
    [
        ("llama", {}),
        ("llama", {"gqa_mode": "repeat_interleave", "rope_style": "slice", "tie_embeddings": True}),
        ("llama", {"shift_labels_inside": True}),
        ("gpt2", {}),
        ("encoder", {}),
        ("encoder", {"pos_style": "learned"}),
    ],
)
def test_compiles_as_one_graph(name: str, overrides: dict) -> None:
    torch._dynamo.reset()
    model, inputs = FACTORIES[name](seq_len=32, **overrides)
    loss_eager, grads_eager = _loss_and_grads(model, inputs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss_compiled, grads_compiled = _loss_and_grads(model, inputs, fn=compiled)
    torch.testing.assert_close(loss_compiled, loss_eager, **TOL)
    for n in grads_eager:
        torch.testing.assert_close(grads_compiled[n], grads_eager[n], **TOL)
