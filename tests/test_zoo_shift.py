"""A label shift inside the model (cp_compile/passes/normalize/loss_shift.py): ``loss(logits[:, :-n], y)``
becomes ``loss(logits, y padded by ignore_index)``, so only integer targets every rank holds whole
move and the logits are never gathered; a slice of a sequence input every rank was passed whole
slices that whole value (cp_compile/passes/propagate/rules/getitem.py). What is not such a shift (a strided
slice, ``reduction="none"``, a slice of hidden states) keeps the gather, warned with its line."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from checks import grad_errors, loss_through_ring_cp, rel, twin_models
from zoo import nanogpt

from cp_compile.tools.explain import explain_model

TOL = 1e-5


def _calls(gm, name: str) -> int:
    return sum(getattr(n.target, "__name__", str(n.target)) == name for n in gm.graph.nodes)


def _sliced(gm) -> list:
    """getitem nodes of the rewritten graph that slice a dim of a float tensor (logits, hidden states)."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.target.__class__.__name__ == "builtin_function_or_method" and getattr(n.target, "__name__", "") == \
                "getitem" and isinstance(val, torch.Tensor) and val.dtype.is_floating_point \
                and isinstance(n.args[1], tuple) and any(isinstance(i, slice) and i != slice(None) for i in n.args[1]):
            out.append(n)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shift", [1, 2])
def test_shifted_loss_has_no_slice_of_the_logits_and_no_gather(shift):
    model, inputs = nanogpt.factory(shift=shift)
    report = explain_model(model, inputs, world_size=2)
    assert report.ctx.record.fallbacks == [] and report.fallbacks == []
    assert _calls(report.after, "gather_seq") == 0
    assert _sliced(report.after) == []  # logits (B, c, V) go to the loss unsliced
    assert _calls(report.after, "pad") == 1  # the targets, padded by ignore_index at the dropped positions
    assert report.ctx.record.sharded_fraction > 0.9


@pytest.mark.slow
def test_targets_read_from_the_token_ids_slice_the_whole_input():
    """targets = idx (one tensor passed twice: one sharded graph input): idx[:, 1:] is a slice of
    the whole input every rank was passed, not of its shard."""
    model, (idx, _) = nanogpt.factory()
    report = explain_model(model, (idx, idx), world_size=4)
    assert report.shard_inputs == {"idx": 1} and report.fallbacks == []
    assert _calls(report.after, "gather_seq") == 0


class _Shifted(nn.Module):
    """Logits, then one of the ways of scoring them against shifted labels."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.emb, self.qkv, self.head = nn.Embedding(37, 24), nn.Linear(24, 72), nn.Linear(24, 37)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, S = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, S, 3, 2, 12).permute(2, 0, 3, 1, 4)  # (B, 2, S, 12) each
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, 24)
        logits = self.head(h)  # (B, S, V)
        if self.form == "strided":
            return F.cross_entropy(logits[:, ::2].reshape(-1, 37), labels[:, ::2].reshape(-1))
        if self.form == "none":
            return F.cross_entropy(logits[:, :-1].reshape(-1, 37), labels[:, 1:].reshape(-1), reduction="none").sum()
        if self.form == "log_softmax":  # the slice behind a cast, a log_softmax and a transpose: (B, V, S-1)
            logp = logits.float()[:, 1:].log_softmax(-1).transpose(1, 2)
            return F.nll_loss(logp, labels[:, :-1].clamp(min=0), ignore_index=0, reduction="sum")  # token 0 ignored
        return F.cross_entropy(logits[:, :-3].reshape(-1, 37), labels[:, 3:].reshape(-1), label_smoothing=0.1)


def _tokens(seq: int = 24):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 37, (2, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(2, seq, generator=g) < 0.2] = -100
    return ids, labels


@pytest.mark.slow
@pytest.mark.parametrize("form", ["strided", "none"])
def test_what_is_not_a_shift_keeps_the_gather_and_names_the_line(form, caplog):
    with caplog.at_level(logging.WARNING, logger="cp_compile"):
        report = explain_model(_Shifted(form), _tokens(), world_size=2)
    assert len(report.fallbacks) == 1, report.fallbacks
    msg = report.fallbacks[0].message
    # (strided: the slice itself; none: the slice is a window, the reshape merging it with the batch is not)
    assert ("slicing the sequence dim" in msg or "merges a slice" in msg) and "test_zoo_shift.py:" in msg \
        and "logits[:, " in msg
    assert any("gathering the full sequence" in r.getMessage() for r in caplog.records)


def _exact(form: str, seq: int):
    torch._dynamo.reset()
    ref_model, cp_model = twin_models(lambda: _Shifted(form))
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, _tokens(seq))
    grads = max(grad_errors(cp_model, ref_model).values())
    gathers = sum(_calls(gm, "gather_seq") for gm in backend.graphs)
    return rel(out.detach(), ref.detach()), grads, len(backend.fallbacks), gathers


@pytest.mark.slow
@pytest.mark.parametrize("world,form,seq", [(2, "smoothed", 24), (4, "log_softmax", 26), (4, "smoothed", 21)])
def test_shifted_losses_are_exact_without_a_gather(ranks, world, form, seq):
    """Shift by 3 with label smoothing; by 1 behind a cast, a log_softmax and a transpose into an
    nll_loss with its own ignore_index and a sum; lengths that need padding (26, 21 on 4 ranks)."""
    for loss_err, grad_err, fallbacks, gathers in ranks.run(world, _exact, form, seq):
        assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)
        assert fallbacks == 0 and gathers == 0


class _NextFrame(nn.Module):
    """Next-frame regression: frames (B, S, 12) in, each position predicts the next frame."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss = F.mse_loss if loss == "mse" else F.l1_loss
        self.qkv, self.out = nn.Linear(12, 36), nn.Linear(12, 12)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        B, S, _ = frames.shape
        q, k, v = self.qkv(frames).view(B, S, 3, 2, 6).permute(2, 0, 3, 1, 4)  # (B, 2, S, 6) each
        pred = self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, 12))
        if self.loss is F.l1_loss:  # the other direction: the first position dropped, padding copies a kept one
            return self.loss(pred[:, 1:], frames[:, :-1])
        return self.loss(pred[:, :-1], frames[:, 1:])


def _exact_next_frame(loss: str, seq: int):
    torch._dynamo.reset()
    ref_model, cp_model = twin_models(lambda: _NextFrame(loss))
    frames = torch.randn(2, seq, 12, generator=torch.Generator().manual_seed(5))
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, (frames,))
    grads = max(grad_errors(cp_model, ref_model).values())
    gathers = sum(_calls(gm, "gather_seq") for gm in backend.graphs)
    return rel(out.detach(), ref.detach()), grads, len(backend.fallbacks), gathers


@pytest.mark.slow
@pytest.mark.parametrize("world,loss,seq", [(2, "mse", 24), (4, "l1", 26)])
def test_next_frame_regression_losses_are_exact_without_a_gather(ranks, world, loss, seq):
    """mse on pred[:, :-1] against frames[:, 1:] (the sequence input, read whole), l1 the other way
    round: terms kept where the slice kept them, the mean over the sliced count; 26 frames on 4
    ranks are padded (padding rows copy the last position, which [:, 1:] keeps: they must not count)."""
    for loss_err, grad_err, fallbacks, gathers in ranks.run(world, _exact_next_frame, loss, seq):
        assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)
        assert fallbacks == 0 and gathers == 0


@pytest.mark.slow
def test_under_a_symbolic_length_the_shift_is_rewritten_too():
    """Dynamic shapes: the bounds [:, :-1] / [:, 1:] mean the same at every length; the target's
    length S - 1 is computed in the graph from the logits' symbolic size."""
    model, inputs = models.llama_factory(seq_len=50, shift_labels_inside=True)
    report = explain_model(model, inputs, world_size=4, dynamic=True)
    assert report.ctx.seq_sym is not None and report.fallbacks == []
    assert _calls(report.after, "gather_seq") == 0
