"""The rewritten graph holds only what runs: no value without a reader (issue 25 item 4).

A mask that became the ring's causal flag (``nn.Transformer.generate_square_subsequent_mask``:
an (S, S) ``full`` + ``triu``) or a whole value of which only this rank's rows were taken would
otherwise stay in the graph, run on every rank, and count in the record's bytes and in
``cp-compile explain`` (passes/rewrite.py ``_drop_dead_code``).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from cp_compile.passes.propagate.emitter import mutates
from checks import twin_models

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class CausalEncoderLM(nn.Module):
    """``nn.TransformerEncoder`` with the causal mask nn.Transformer builds, and is_causal=True."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])  # (S, S) float, -inf above
        x = self.enc(self.emb(tokens), mask=mask, is_causal=True)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(0, 1))


def _dead(gm: fx.GraphModule) -> list:
    return [n.format_node() for n in gm.graph.nodes
            if n.op in ("call_function", "call_method") and not n.users and not mutates(n)]


@pytest.mark.slow
def test_no_dead_values_after_the_rewrite() -> None:
    from cp_compile.tools.explain import explain_model

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2))
    report = explain_model(CausalEncoderLM(), (tokens, labels), world_size=2)
    assert report.rewritten and [m.call.causal for m in report.rings] == [True, True], report.rings
    assert _dead(report.after) == [], _dead(report.after)
    targets = {n.target for n in report.after.graph.nodes}
    assert not targets & {torch.full, torch.triu, "triu", "full"}, sorted(map(str, targets))
    # the record's bytes describe what runs: nothing (S, S) is left to count
    square = [n.name for n in report.after.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
              and v.dim() >= 2 and v.shape[-1] == v.shape[-2] == SEQ]
    assert square == [], square


def _affine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b + b


class VmappedScan(nn.Module):
    """torch.vmap inside the model (HF Jamba's mamba scan): Dynamo inlines it as functorch level
    bookkeeping calls that return nothing and carry no fake value; they must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 3 * DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.vmap(_affine)(self.emb(tokens), self.emb(tokens))  # (B, S, D), vmapped over the batch
        q, k, v = self.qkv(h).view(*tokens.shape, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def _vmapped() -> dict:
    import cp_compile
    from checks import grad_errors, rel

    ref_model, cp_model = twin_models(VmappedScan)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ref = ref_model(tokens)
    ref.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    out = torch.compile(cp_model, backend=backend, fullgraph=True)(tokens)
    out.backward()
    calls = [getattr(n.target, "__name__", "") for gm in backend.graphs for n in gm.graph.nodes]
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grad_errors(cp_model, ref_model).values()),
            "nesting": calls.count("_vmap_increment_nesting"), "rings": sum(r.rings for r in backend.records)}


def test_calls_made_for_their_effect_stay(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _vmapped, timeout=240)):
        assert r["nesting"] == 1 and r["rings"] == 1, (rank, r)
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, (rank, r)



class DeadCopies(nn.Module):
    """Hand-written causal attention with dead copies of its scores and weights, next to a dead in-place
    add on a value that is read (kept) and a dead dropout (kept: it draws random numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, D)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5
        kept = scores.clone()  # never read
        kept.float().transpose(-1, -2)  # nor these
        F.dropout(x, 0.5, self.training)  # never read, but it draws random numbers
        y = x * 1.0
        y += 1.0  # its result unread, its write read below
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        weights = torch.softmax(scores, -1)
        weights.detach()  # never read
        out = weights @ v
        return out.transpose(1, 2).reshape(b, s, DIM) + y


def test_dead_copies_of_the_scores_do_not_hide_the_attention() -> None:
    """Dead copies made the matcher see the scores "also used elsewhere" and leave the attention whole:
    now they are no readers, the attention is the ring, and the copies go with the scores; what has
    an effect of its own stays."""
    from cp_compile.group import CPGroup
    from cp_compile.passes.context import RewriteContext
    from cp_compile.passes.normalize.fuse_attention import fuse_attention
    from checks import explain_record

    record = explain_record(DeadCopies(), (torch.randn(2, SEQ, DIM),))
    assert record.rings == 1 and not record.fallbacks, record
    graphs = []
    torch._dynamo.reset()
    torch.compile(DeadCopies().train(), backend=lambda gm, ex: graphs.append(gm) or gm, fullgraph=True)(
        torch.randn(2, SEQ, DIM))
    gm = graphs[0]
    assert fuse_attention(gm, RewriteContext(group=CPGroup(pg=None, rank=0, size=2))) == 1, gm.code
    names = [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes]
    assert not {"clone", "softmax", "float", "detach"} & set(names), names  # the chain and its dead copies
    assert names.count("transpose") == 1, names  # the output's (kᵀ and the dead copy's went)
    assert "dropout" in names and "iadd" in names, names
