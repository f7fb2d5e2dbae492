"""The per-graph record (cp_compile/backend/record.py): what CP a graph got, one code path for the
runtime and ``cp-compile explain`` (the tests of whole models compare ``RingCP.records``
with explain's record; see tests/checks.py). Here: the sharded fraction, and the WARNING
when most of a rewritten graph stays whole on every rank."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models

from cp_compile.tools.explain_format import format_explain
from cp_compile.tools.explain import explain_model


class _MixesEarly(nn.Module):
    """Tokens mixed right after the embedding. ``mix="cumsum"``: a running sum, shaped like its
    input, gathered under ``load_balance="striped"`` (no contiguous runs to scan; the other layouts
    scan without a gather, rules/scans.py), and the fallback's result is sharded again at once.
    ``mix="rotate"``: a rotation by slices and a cat, whose pieces (S-1 and 1 tokens) stay whole,
    so every op from there on runs on the whole sequence until the attention shards its q/k/v."""

    def __init__(self, mix: str) -> None:
        super().__init__()
        self.mix = mix
        self.emb, self.qkv = nn.Embedding(32, 16), nn.Linear(16, 48)
        self.mlp = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # (B, S, 16)
        x = x.cumsum(dim=1) if self.mix == "cumsum" else torch.cat([x[:, -1:], x[:, :-1]], dim=1)
        x = self.mlp(x)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, 2, S, 8) each
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.slow
def test_fully_sharded_model_records_a_high_fraction() -> None:
    model, inputs = models.llama_factory()
    for world in (2, 4):
        rec = explain_model(model, inputs, world_size=world).ctx.record
        assert rec.rings == len(rec.attention) == 2 and rec.fallbacks == []
        assert rec.shard_inputs == {"input_ids": 1}
        assert rec.sharded_fraction > 0.9, rec  # everything but the weights' uses is per token


def test_a_fallback_shaped_like_its_input_is_sharded_again() -> None:
    """The cumsum runs on the gathered sequence (striped); the MLP after it holds 1/N of the tokens (views
    hold no bytes, so in this tiny model the one gathered (B, S, D) value is a third of what is held)."""
    report = explain_model(_MixesEarly("cumsum"), (torch.randint(0, 32, (2, 16)),), world_size=2,
                           load_balance="striped")
    rec = report.ctx.record
    assert rec.rings == 1 and len(rec.fallbacks) == 1 and rec.sharded_fraction > 0.6, rec


def test_a_mostly_whole_graph_warns_and_explain_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="cp_compile"):
        report = explain_model(_MixesEarly("rotate"), (torch.randint(0, 32, (2, 16)),), world_size=2)
    rec = report.ctx.record
    assert rec.rings == 1 and len(rec.fallbacks) == 2 and rec.sharded_fraction < 0.5, rec
    assert any("of its activation bytes sharded" in r.getMessage() and "test_record.py:" in r.getMessage()
               for r in caplog.records)
    assert f"record: {rec.summary()}" in format_explain(report)


class _FloatDocMask(nn.Module):
    """Documents compared as float ids: no document term the ring op takes (ids must be integers),
    so the mask stays explicit, c x S float32 rows per rank, more than the rest of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        s, ids, pos = x.shape[1], doc.float(), torch.arange(x.shape[1])
        mask = ((ids[:, :, None] == ids[:, None, :]) & (pos[None, :] <= pos[:, None]))[:, None]  # (1, 1, S, S)
        q, k, v = (t.view(1, s, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def test_a_graph_mostly_of_mask_rows_warns_naming_the_mask(caplog) -> None:
    """The low-fraction WARNING says what holds the bytes: here the explicit mask rows, not a fallback."""
    doc = torch.repeat_interleave(torch.arange(4), 64)[None]  # (1, 256): four documents
    with caplog.at_level(logging.WARNING, logger="cp_compile"):
        rec = explain_model(_FloatDocMask(), (torch.randn(1, 256, 16), doc), world_size=2).ctx.record
    assert rec.fallbacks == [] and rec.sharded_fraction < 0.5, rec
    assert rec.masks == ["causal + explicit; per rank: attn_mask (1, 1, 128, 256) float32 128.0 KiB"], rec.masks
    low = [r.getMessage() for r in caplog.records if "of its activation bytes sharded" in r.getMessage()]
    assert len(low) == 1 and "most of it is explicit attention-mask rows (causal + explicit" in low[0], low


def _resharded(seq_len: int) -> tuple:
    from checks import grad_errors, loss_through_ring_cp, rel

    torch._dynamo.reset()
    models_ = []
    for _ in range(2):
        torch.manual_seed(0)
        models_.append(_MixesEarly("cumsum"))
    inputs = (torch.randint(0, 32, (2, seq_len), generator=torch.Generator().manual_seed(1)),)
    ref, out, backend = loss_through_ring_cp(models_[0], models_[1], inputs, load_balance="striped")
    return rel(out.detach(), ref.detach()), max(grad_errors(models_[1], models_[0]).values()), len(backend.fallbacks)


@pytest.mark.parametrize("world,seq_len", [(2, 16), (4, 16), (2, 15)])
def test_a_resharded_fallback_is_exact(ranks, world: int, seq_len: int) -> None:
    for rank, (loss_err, grad_err, fallbacks) in enumerate(ranks.run(world, _resharded, seq_len, timeout=240)):
        assert loss_err <= 1e-5 and grad_err <= 1e-5 and fallbacks == 1, (rank, loss_err, grad_err, fallbacks)


def _break_before_head() -> dict:
    """The example Llama with a graph break before its final norm and head: the second graph
    has no attention and takes the whole (B, S, D) hidden states."""
    from checks import AttentionCount, explain_record, pieces_mismatches, ring_mismatches

    torch._dynamo.reset()
    (ref_model, inputs), (cp_model, _) = (models.llama_factory(graph_break_before_head=True) for _ in range(2))
    # explain traces one graph and refuses graph breaks (its error: remove them): its record of the
    # model without the break is compared with what the runtime's two graphs show of it together
    explained = explain_record(models.llama_factory()[0], inputs, world_size=2)
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("cp_compile").addHandler(handler)
    try:
        backend = __import__("cp_compile").RingCP(inner="aot_eager")
        out = torch.compile(cp_model, backend=backend)(*inputs)
    finally:
        logging.getLogger("cp_compile").removeHandler(handler)
    assert not pieces_mismatches(backend.records, explained), (pieces_mismatches(backend.records, explained),
                                                               backend.records)
    with AttentionCount() as count:
        ref = ref_model(*inputs)
    err = ((out.double() - ref.double()).abs() / out.double().abs()).item()
    plain = [r for r in backend.records if not r.attention]
    return {"err": err, "rings": ring_mismatches(backend, count.calls),
            "whole": [r.whole_inputs for r in plain], "summary": [r.summary() for r in plain],
            "warnings": [r.getMessage() for r in records if "has no attention but takes" in r.getMessage()]}


def test_a_graph_after_a_break_that_runs_whole_is_reported(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _break_before_head, timeout=240)):
        assert r["err"] <= 1e-5 and not r["rings"], (rank, r)
        assert len(r["whole"]) == 1 and r["whole"][0] and "(2, 64, " in r["whole"][0][0], (rank, r)
        assert "takes sequence-long inputs" in r["summary"][0], (rank, r)
        assert len(r["warnings"]) == 1 and "models.py:" in r["warnings"][0] and "Fix:" in r["warnings"][0], (rank, r)
