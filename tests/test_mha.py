"""nn.MultiheadAttention and nn.Transformer* layers become ring attention (passes/expand_mha.py).

Dynamo keeps ``F.multi_head_attention_forward`` as one opaque node; the pass opens it
into the ops torch runs, ending in ``scaled_dot_product_attention``, so these models get
context parallelism like hand-written ones. Each rank compares loss and every parameter
gradient with the uncompiled model on one process, and checks that every attention
became the ring op with no gather fallback. Uses the attention weights, or
cross-attention, are left whole with a warning naming the line and the fix.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cp_compile
from checks import explain_record

TOL = 1e-5
VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class CausalLM(nn.Module):
    """(1) pre-norm ``nn.TransformerEncoder`` (batch_first), causal float mask + is_causal=True."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])  # (S, S) float, -inf above
        x = self.enc(self.emb(tokens), mask=mask, is_causal=True)  # (B, S, D)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(0, 1))


class PaddedSeqFirst(nn.Module):
    """(2) ``batch_first=False`` (sequence at dim 0), bool key-padding mask, not causal."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0)
        self.head = nn.Linear(DIM, 1)  # post-norm output: mean(y ** 2) would be ~1 whatever the weights

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).transpose(0, 1)  # (S, B, D)
        y = self.layer(x, src_key_padding_mask=padding)  # padding (B, S) bool, True = ignore that key
        return self.head(y).square().mean()


class DirectMHA(nn.Module):
    """(3)/(4) ``nn.MultiheadAttention`` called directly; (5) its weights returned too."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.proj = nn.Linear(DIM, DIM)
        self.mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (B, S, D)
        if self.style == "bool_causal":
            causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1)  # True = not allowed
            out = self.mha(h, h, h, need_weights=False, attn_mask=causal)[0]
        elif self.style == "weights_unused":
            out, _ = self.mha(h, h, h)  # need_weights=True by default; the weights are dropped
        else:  # "weights_used"
            out, weights = self.mha(h, h, h)
            return out.square().mean() + weights.square().mean()
        return out.square().mean()


class CrossAttention(nn.Module):
    """(6) query from one sequence, keys and values from another."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)  # a sequence-first attention ring_cp can see, so the graph is rewritten
        own = F.scaled_dot_product_attention(q[:, None], q[:, None], q[:, None], is_causal=True)[:, 0]
        return self.mha(own, memory, memory, need_weights=False)[0].square().mean()


def _model(name: str):
    torch.manual_seed(0)
    if name == "causal_lm":
        ids = torch.randint(0, VOCAB, (2, SEQ))
        return CausalLM(), (ids, ids.roll(-1, 1))
    if name == "padded_seq_first":
        padding = torch.zeros(2, SEQ, dtype=torch.bool)
        padding[1, -5:] = True  # the second sequence is 11 tokens long
        return PaddedSeqFirst(), (torch.randint(0, VOCAB, (2, SEQ)), padding)
    if name == "cross_attention":
        return CrossAttention(), (torch.randn(2, SEQ, DIM), torch.randn(2, SEQ, DIM))
    return DirectMHA(name), (torch.randn(2, SEQ, DIM),)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(name: str, strict: bool = False, explain: bool = False) -> dict:
    """On every rank: loss / gradient errors vs one process, ring ops, fallbacks, warnings.
    ``explain``: also check that cp-compile explain's record is the runtime's (it logs the
    same warnings first, once per line, so the warning tests leave it off)."""
    torch._dynamo.reset()
    (ref_model, inputs), (cp_model, _) = _model(name), _model(name)
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size()) if explain else None
    ref = ref_model(*inputs)
    ref.backward()
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("cp_compile")
    logger.addHandler(handler)
    backend = cp_compile.RingCP(inner="aot_eager", strict=strict)
    try:
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(*inputs)
        out.backward()
    except Exception as e:  # Dynamo wraps backend errors
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        logger.removeHandler(handler)
    if explain:
        assert backend.records == [explained], (backend.records, explained)
    params = zip(cp_model.named_parameters(), ref_model.parameters())
    grad_errs = {name: _rel(p.grad, q.grad) for (name, p), q in params}
    targets = [str(n.target) for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "loss_err": _rel(out.detach(), ref.detach()), "grad_err": max(grad_errs.values()),
        "worst_grad": max(grad_errs, key=grad_errs.get),
        "ring": sum("ring_attention_fwd" in t for t in targets),
        "mha_left": sum("multi_head_attention_forward" in t for t in targets),
        "fallbacks": list(backend.fallbacks), "warnings": [r.getMessage() for r in records],
    }


CASES = [("causal_lm", 2, 2), ("causal_lm", 4, 2), ("padded_seq_first", 2, 1), ("bool_causal", 2, 1),
         ("weights_unused", 2, 1)]


@pytest.mark.parametrize("name,world,attentions", CASES)
def test_mha_becomes_ring_attention(ranks, name: str, world: int, attentions: int) -> None:
    for rank, r in enumerate(ranks.run(world, _run, name, False, True, timeout=240)):
        assert "error" not in r, (rank, r)
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (rank, r)
        assert r["ring"] == attentions and r["mha_left"] == 0, (rank, r)
        assert r["fallbacks"] == [], (rank, r["fallbacks"])


def test_used_weights_are_left_whole_with_a_warning(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _run, "weights_used", timeout=240)):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (rank, r)
        left = [w for w in r["warnings"] if "is left whole" in w]
        assert left and "need_weights" in left[0] and "test_mha.py:" in left[0] and "Fix:" in left[0], r["warnings"]
        assert any("attention that ring_cp cannot split" in w for w in r["warnings"]), r["warnings"]


def test_cross_attention_is_refused_with_the_fix(ranks) -> None:
    for rank, r in enumerate(ranks.run(2, _run, "cross_attention", timeout=240)):
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (rank, r)
        assert r["ring"] == 1 and r["mha_left"] == 1, (rank, r)  # the plain SDPA is the ring, the MHA whole
        left = [w for w in r["warnings"] if "is left whole" in w]
        assert left and "cross-attention" in left[0] and "test_mha.py:" in left[0], r["warnings"]
    (r,) = ranks.run(2, _run, "cross_attention", True, timeout=240)[:1]
    assert "strict=True" in r.get("error", "") and "cross-attention" in r["error"], r
