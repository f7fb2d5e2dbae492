"""The per-graph record (cp_compile/record.py): what CP a graph got, one code path for the
runtime and ``cp-compile explain`` (the tests of whole models compare ``RingCP.records``
with explain's record; see tests/checks.py). Here: the sharded fraction, and the WARNING
when most of a rewritten graph stays whole on every rank."""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import models  # noqa: E402

from cp_compile.inspect_format import format_explain  # noqa: E402
from cp_compile.inspect_graph import inspect  # noqa: E402


class _MixesEarly(nn.Module):
    """A running sum over the sequence right after the embedding (mixes tokens): every op
    from there on runs on the gathered, whole sequence until the attention re-shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(32, 16), nn.Linear(16, 48)
        self.mlp = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.mlp(self.emb(ids).cumsum(dim=1))  # (B, S, 16), gathered before the cumsum
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, 2, S, 8) each
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_fully_sharded_model_records_a_high_fraction() -> None:
    model, inputs = models.llama_factory()
    for world in (2, 4):
        rec = inspect(model, inputs, world_size=world).ctx.record
        assert rec.rings == len(rec.attention) == 2 and rec.fallbacks == []
        assert rec.shard_inputs == {"input_ids": 1}
        assert rec.sharded_fraction > 0.9, rec  # everything but the weights' uses is per token


def test_a_mostly_whole_graph_warns_and_explain_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="cp_compile"):
        report = inspect(_MixesEarly(), (torch.randint(0, 32, (2, 16)),), world_size=2)
    rec = report.ctx.record
    assert rec.rings == 1 and len(rec.fallbacks) == 1 and rec.sharded_fraction < 0.5, rec
    assert any("of its activation bytes sharded" in r.getMessage() and "test_record.py:" in r.getMessage() for r in caplog.records)
    assert f"record: {rec.summary()}" in format_explain(report)
