"""Attention is always the ring (docs/design.md §7).

With a CP group of 2 or more ranks, no ``scaled_dot_product_attention`` over the whole
sequence survives the rewrite: q/k/v that every rank holds whole (nothing upstream is a
sharded input) are indexed by this rank's positions, which needs no communication. The
model here is a ViT-style encoder whose sequence arises inside the graph: a cls token is
concatenated before S-1 patch embeddings, so no input has the attention's length S, and
before this rule every rank ran plain SDPA on the whole sequence, silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import grad_errors, loss_through_ring_cp, rel

TOL = 1e-5


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, D // self.heads)  # (B, S, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, S, Dh)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ClsViT(nn.Module):
    """Patches (B, S-1, P) -> [cls; patches] (B, S, D) + learned positions -> 2 blocks -> mean pool."""

    def __init__(self, n_patches: int, patch_dim: int = 12, dim: int = 32, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(2))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, patches: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(patches)  # (B, S-1, D)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, S, D)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x).mean(dim=1)), labels)


def _vit(seq_len: int):
    torch.manual_seed(0)
    model = ClsViT(n_patches=seq_len - 1)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(2, seq_len - 1, 12, generator=g), torch.randint(0, 10, (2,), generator=g))


def _compare(seq_len: int) -> dict:
    (ref_model, inputs), (cp_model, _) = _vit(seq_len), _vit(seq_len)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs)
    targets = [n.target for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "loss": rel(out.detach(), ref.detach()),
        "grad": max(grad_errors(cp_model, ref_model).values()),
        "rings": sum(t is torch.ops.cp_compile.ring_attention_fwd.default for t in targets),
        "sdpa": sum(t is F.scaled_dot_product_attention for t in targets),
        "fallbacks": len(backend.fallbacks),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world,seq_len", [(2, 16), (4, 16), (2, 15)])  # 15: padded to 16 on 2 ranks
def test_attention_on_whole_values_becomes_the_ring(ranks, world: int, seq_len: int) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, seq_len, timeout=240)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["rings"] == 2 and r["sdpa"] == 0, (rank, r)  # both attentions: the ring, none whole
        assert r["fallbacks"] == 0, (rank, r)  # nothing gathered to the whole sequence


def test_explain_shows_where_the_sequence_arises() -> None:
    """cp-compile explain's code path (explain_model, no process group) makes the same rewrite: the
    ``cat`` of cls and patches is sharded right where it is computed (passes/seq_origins.py), so
    everything after it holds 1/N of the tokens; only the patch embedding runs whole."""
    from cp_compile.tools.explain_format import format_explain
    from cp_compile.tools.explain import explain_model

    model, inputs = _vit(16)
    report = explain_model(model, inputs, world_size=2)
    after = [n.target for n in report.after.graph.nodes if n.op == "call_function"]
    assert F.scaled_dot_product_attention not in after
    assert sum(t is torch.ops.cp_compile.ring_attention_fwd.default for t in after) == 2
    assert list(report.ctx.shard_nodes.values()) == [1], report.ctx.shard_nodes
    assert report.act_bytes_local / report.act_bytes_global < 0.6, (report.act_bytes_local, report.act_bytes_global)
    assert "the sequence arises at cat (" in format_explain(report)


def test_post_condition_refuses_a_surviving_whole_attention() -> None:
    """A rewritten graph that still holds whole-sequence SDPA is a bug, reported, never run."""
    from types import SimpleNamespace

    import torch.fx as fx

    from cp_compile.passes.context import CPRewriteError
    from cp_compile.passes.propagate.rewrite import _check_every_attention_is_the_ring

    graph = fx.Graph()
    q = graph.placeholder("q")
    sdpa = graph.call_function(F.scaled_dot_product_attention, (q, q, q))
    graph.output(sdpa)
    em = SimpleNamespace(graph=graph, ctx=SimpleNamespace(attention=[sdpa]))
    with pytest.raises(CPRewriteError, match="left 1 scaled_dot_product_attention on the whole sequence"):
        _check_every_attention_is_the_ring(em)
