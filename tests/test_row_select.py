"""Where the sequence is assembled inside the model, each rank computes only its own rows.

A cat of a cls token, register tokens and S-R patch (or text) embeddings along the
sequence is the *origin* of the sequence (no input has attention's length S). The
rewrite selects this rank's positions there and moves the selection up into the pieces
of the cat and through the per-token ops that made them (``passes/row_select.py``),
so the patch embedding runs on this rank's patches only. Checked on every rank:

* loss and every parameter gradient against one process on the whole sequence;
* no op after the graph inputs holds a whole piece (or the whole sequence) along
  the sequence dim: every activation is this rank's share;
* explain's record for this rank equals the runtime's (``checks.loss_through_ring_cp``);
* one position read off the sequence (``x[:, 0]`` cls pooling, ``x[:, -1]`` last token) is
  picked on the rank that holds it and all-reduced, not gathered (no fallback).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import grad_errors, loss_through_ring_cp, rel

TOL = 1e-5
P, D, H = 5, 32, 4  # patch features, model width, heads


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, S, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, S, Dh)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, D))


class RegisterViT(nn.Module):
    """[cls; registers; patches + their positions] along the sequence, then attention."""

    def __init__(self, n_patches: int, registers: int = 3) -> None:
        super().__init__()
        self.patch = nn.Linear(P, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.reg = nn.Parameter(torch.randn(1, registers, D) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n_patches, D) * 0.02)  # per patch, added before the cat
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(D, 10)

    def forward(self, patches: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B = patches.shape[0]
        x = F.gelu(self.patch(patches)) + self.pos  # (B, S-R-1, D)
        x = torch.cat([self.cls.expand(B, -1, -1), self.reg.expand(B, -1, -1), x], dim=1)  # (B, S, D)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x[:, 0]), labels)


class ImageText(nn.Module):
    """Image patch embeddings and text token embeddings concatenated along the sequence."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.patch, self.tok = nn.Linear(P, D), nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.lm = nn.Linear(D, vocab)

    def forward(self, patches: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.patch(patches), self.tok(tokens)], dim=1)  # (B, S_img + S_txt, D)
        for block in self.blocks:
            x = block(x)
        return self.lm(x).float().logsumexp(-1).mean() + self.lm(x[:, -1]).square().mean()  # + last token


def _build(kind: str, seq_len: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "registers":
        n = seq_len - 4
        return RegisterViT(n), (torch.randn(2, n, P, generator=g), torch.randint(0, 10, (2,), generator=g))
    n_img = {16: 7, 15: 5}[seq_len]  # no piece as long as some rank's share of a piece (the check below)
    return ImageText(), (torch.randn(2, n_img, P, generator=g), torch.randint(0, 50, (2, seq_len - n_img), generator=g))


def _whole_rows(gm: torch.fx.GraphModule, lengths: set) -> list:
    """Activations (past the inputs and the parameters' gradient hooks) with a whole piece's (or the
    sequence's) length at dim 1."""
    from cp_compile import graph_ops

    params = {graph_ops.grad_all_reduce, graph_ops.grad_all_reduce_bucket}
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        src = n.args[0] if n.target is operator.getitem and n.args else n
        if n.op in ("call_function", "call_method") and isinstance(val, torch.Tensor) and val.dim() >= 2 \
                and val.shape[1] in lengths and getattr(src, "target", None) not in params:
            out.append(f"{n.name} {tuple(val.shape)}")
    return out


def _compare(kind: str, seq_len: int) -> dict:
    (ref_model, inputs), (cp_model, _) = _build(kind, seq_len), _build(kind, seq_len)
    ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs)
    pieces = {t.shape[1] for t in inputs if t.dim() >= 2}
    return {
        "loss": rel(out.detach(), ref.detach()),
        "grad": max(grad_errors(cp_model, ref_model).values()),
        "whole": [w for gm in backend.graphs for w in _whole_rows(gm, pieces | {seq_len})],
        "origins": [sorted(r.shard_nodes.values()) for r in backend.records],  # the cat's sequence dim
        "fallbacks": len(backend.fallbacks),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["registers", "image_text"])
@pytest.mark.parametrize("world,seq_len", [(2, 16), (4, 16), (2, 15)])  # 15: padded on 2 ranks
def test_each_rank_computes_only_its_rows_of_the_pieces(ranks, kind: str, world: int, seq_len: int) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, kind, seq_len, timeout=240)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["origins"] == [[1]] and r["fallbacks"] == 0, (rank, r)
        assert r["whole"] == [], f"rank {rank} holds whole pieces: {r['whole']}"
