"""Per-token ids reading a whole table (cp_compile/passes/propagate/rules/getitem.py ``_table_lookup``):
``cos_cached[position_ids]`` with the ids sharded like the tokens is this rank's rows of the
result, read from the whole table with no communication (examples/zoo/position_ids.py). Indexing
a sharded value with tensors, or a table with sharded booleans, is still gathered and warned."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import position_ids
from zoo.measure import measure

from cp_compile.tools.explain import explain_model


@pytest.mark.slow
def test_a_rope_cache_read_at_position_ids_is_sharded_where_the_ids_are():
    model, kwargs = position_ids.factory()
    report = explain_model(model, (), world_size=4, example_kwargs=kwargs)
    assert report.shard_inputs["position_ids"] == 1 and report.fallbacks == []
    reads = [n for n in report.after.graph.nodes if n.name in ("cos", "sin")]
    assert len(reads) == 2
    for n in reads:  # (B, S, hd) -> this rank's (B, c, hd), read from the whole (MAX_POS, hd) cache
        assert tuple(n.meta["val"].shape) == (3, 20, 8)
        assert n.args[0].op == "get_attr" or "cached" in n.args[0].name


class _Reads(nn.Module):
    """Tensor indexing the rule does not take: the sharded hidden states reordered by a permutation."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(37, 24), nn.Linear(24, 72)
        self.register_buffer("perm", torch.randperm(16, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, S = ids.shape
        x = self.emb(ids)  # (B, S, 24)
        x = x[:, self.perm]  # tokens reordered: mixes tokens
        q, k, v = self.qkv(x).view(B, S, 3, 2, 12).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_indexing_a_sharded_value_with_tensors_is_gathered_and_named():
    report = explain_model(_Reads(), (torch.randint(0, 37, (2, 16)),), world_size=2)
    assert len(report.fallbacks) == 1
    msg = report.fallbacks[0].message
    assert "indexing with tensors on a sharded value" in msg and "test_zoo_positions.py:" in msg
    assert "x[:, self.perm]" in msg


@pytest.mark.slow
@pytest.mark.parametrize("world,seq", [(4, 50)])
def test_position_ids_member_with_padding_is_exact(ranks, world, seq):
    """50 tokens on 4 ranks: padding rows read the clamped last id, and count nowhere."""
    for r in ranks.run(world, measure, "position_ids", seq, timeout=300):
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, (r["loss"], r["grad"], r["grad_name"])
        assert r["fallbacks"] == [] and r["ring_mismatches"] == [] and r["attention"] == 2, r["ring_mismatches"]
