"""nn.MultiheadAttention and nn.Transformer* layers become ring attention (passes/expand_mha.py).

Dynamo keeps ``F.multi_head_attention_forward`` as one opaque node; the pass opens it
into the ops torch runs, ending in ``scaled_dot_product_attention``, so these models get
context parallelism like hand-written ones. Each rank compares loss and every parameter
gradient with the uncompiled model on one process, and checks that every attention
became the ring op with no gather fallback. Uses the attention weights, or
cross-attention, are left whole with a warning naming the line and the fix.

In eval mode under ``torch.no_grad`` each ``nn.TransformerEncoderLayer`` takes its fast
path, which Dynamo records as one ``torch._transformer_encoder_layer_fwd`` node;
passes/expand_fastpath.py opens it the same way (post- and pre-norm, ReLU and GELU,
causal / key-padding / both masks), and the outputs are compared with the uncompiled
model. A bare ``nn.MultiheadAttention`` never takes its fast path under Dynamo (the
slow path is traced), and ``torch._native_multi_head_attention`` called directly is
opened too, or refused with the fix when its weights are used.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cp_compile
from checks import AttentionCount, explain_record, grad_errors, rel, ring_mismatches

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


def _run(name: str, strict: bool = False, explain: bool = False) -> dict:
    """On every rank: loss / gradient errors vs one process, ring ops, fallbacks, warnings.
    ``explain``: also check that cp-compile explain's record is the runtime's (it logs the
    same warnings first, once per line, so the warning tests leave it off)."""
    (ref_model, inputs), (cp_model, _) = _model(name), _model(name)
    explained = explain_record(ref_model, inputs, world_size=dist.get_world_size()) if explain else None
    with AttentionCount() as count:
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
    grad_errs = grad_errors(cp_model, ref_model)
    targets = [str(n.target) for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "loss_err": rel(out.detach(), ref.detach()), "grad_err": max(grad_errs.values()),
        "worst_grad": max(grad_errs, key=grad_errs.get),
        "ring": sum("ring_attention_fwd" in t for t in targets),
        "ring_mismatches": ring_mismatches(backend, count.calls),
        "mha_left": sum("multi_head_attention_forward" in t for t in targets),
        "fallbacks": list(backend.fallbacks), "warnings": [r.getMessage() for r in records],
    }


CASES = [("causal_lm", 2, 2), ("causal_lm", 4, 2), ("padded_seq_first", 2, 1), ("bool_causal", 2, 1),
         ("weights_unused", 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,attentions", CASES)
def test_mha_becomes_ring_attention(ranks, name: str, world: int, attentions: int) -> None:
    for rank, r in enumerate(ranks.run(world, _run, name, False, True, timeout=240)):
        assert "error" not in r, (rank, r)
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, (rank, r)
        assert r["ring"] == attentions and r["mha_left"] == 0 and not r["ring_mismatches"], (rank, r)
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


# -- eval mode under no_grad: the fast paths (passes/expand_fastpath.py) -----------------------------
class EvalEncoder(nn.Module):
    """(7) ``nn.TransformerEncoder`` (batch_first) run in eval mode under ``torch.no_grad``: each
    layer takes its fast path, which Dynamo records as ``torch._transformer_encoder_layer_fwd``."""

    def __init__(self, norm_first: bool, activation: str, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm_first, layer_norm_eps=1e-4)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # eager nested zeroes padded rows

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, S, D)
        if self.mask == "causal":
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])  # (S, S) float, -inf above
            return self.enc(x, mask=mask, is_causal=True)  # (B, S, D)
        if self.mask == "padding":
            return self.enc(x, src_key_padding_mask=padding)  # padding (B, S) bool, True = ignore that key
        if self.mask == "both":  # the two masks of one dtype (torch warns otherwise: a graph break)
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])  # (S, S)
            pad = torch.zeros(padding.shape).masked_fill(padding, float("-inf"))  # (B, S) float
            return self.enc(x, mask=mask, src_key_padding_mask=pad, is_causal=True)
        return self.enc(x)


class EvalMHA(DirectMHA):
    """(8) bare ``nn.MultiheadAttention`` in eval mode under no_grad, ``need_weights=False``;
    (9) its fast-path op called directly, its weights (10) used (DirectMHA's layers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (B, S, D)
        if self.style == "mha":
            return self.mha(h, h, h, need_weights=False)[0]  # (B, S, D)
        m = self.mha
        out, weights = torch._native_multi_head_attention(
            h, h, h, DIM, HEADS, m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias,
            need_weights=self.style == "native_weights")  # (B, S, D), (B, S, S)
        return out + weights.mean() if self.style == "native_weights" else out


def _eval_model(name: str):
    torch.manual_seed(0)
    if name in ("mha", "native", "native_weights"):
        return EvalMHA(name).eval(), (torch.randn(2, SEQ, DIM),)
    norm_first, activation, mask = name.split("-")
    padding = torch.zeros(2, SEQ, dtype=torch.bool)
    padding[1, -5:] = True
    model = EvalEncoder(norm_first == "pre", activation, mask).eval()
    return model, (torch.randint(0, VOCAB, (2, SEQ)), padding)


def _run_eval(name: str) -> dict:
    """On every rank, under no_grad: the output's error vs one process, what Dynamo recorded, the ring ops."""
    (ref_model, inputs), (cp_model, _) = _eval_model(name), _eval_model(name)
    world = dist.get_world_size()
    seen: list = []
    backend = cp_compile.RingCP(inner="aot_eager")

    def recording(gm, example_inputs):  # what Dynamo hands the backend, before any pass
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return backend(gm, example_inputs)

    with torch.no_grad():
        with AttentionCount() as count:
            ref = ref_model(*inputs)
        try:
            explained = explain_record(ref_model, inputs, world_size=world)
            out = torch.compile(cp_model, backend=recording, fullgraph=True)(*inputs)
        except Exception as e:  # Dynamo wraps backend errors
            return {"error": f"{type(e).__name__}: {e}"}
    assert backend.records == [explained], (backend.records, explained)
    rings = [n for gm in backend.graphs for n in gm.graph.nodes if "ring_attention_fwd" in str(n.target)]
    targets = [str(n.target) for gm in backend.graphs for n in gm.graph.nodes]
    return {
        "err": rel(out, ref), "fast_path": sum("_transformer_encoder_layer_fwd" in t for t in seen),
        "ring_mismatches": ring_mismatches(backend, count.calls),
        "mha_traced": sum("multi_head_attention" in t for t in seen),
        "rings": [(n.args[3], "attn_mask" in n.kwargs) for n in rings],
        "q_rows": [n.args[0].meta["example_value"].shape[-2] for n in rings], "world": world,
        "whole": [t for t in targets if any(op in t for op in ("scaled_dot_product", "_transformer_encoder_layer",
                                                                "multi_head_attention"))],
        "fallbacks": list(backend.fallbacks), "summary": backend.records[0].summary(),
    }


# name (norm: post|pre, activation, mask), world, the ring op's (causal, explicit mask) in each layer
EVAL_CASES = [("post-relu-causal", 2, (True, False)), ("pre-gelu-causal", 2, (True, False)),
              ("pre-relu-causal", 4, (True, False)), ("post-gelu-padding", 2, (False, True)),
              ("pre-relu-both", 2, (True, True)), ("pre-gelu-none", 4, (False, False))]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,ring", EVAL_CASES, ids=[f"{c[0]}-{c[1]}" for c in EVAL_CASES])
def test_eval_fast_path_becomes_ring_attention(ranks, name: str, world: int, ring: tuple) -> None:
    for rank, r in enumerate(ranks.run(world, _run_eval, name, timeout=240)):
        assert "error" not in r, (rank, r)
        assert r["fast_path"] == 2 and r["mha_traced"] == 0, (rank, r)  # Dynamo recorded the fused layer
        assert r["err"] <= TOL, (rank, r)
        assert r["rings"] == [ring, ring] and r["whole"] == [] and r["fallbacks"] == [], (rank, r)
        assert not r["ring_mismatches"], (rank, r["ring_mismatches"])
        assert r["q_rows"] == [SEQ // world] * 2, (rank, r)  # every rank attends with its 1/N of the queries


@pytest.mark.parametrize("world", [2, 4])
def test_eval_multihead_attention_becomes_ring_attention(ranks, world: int) -> None:
    """Dynamo never records ``torch._native_multi_head_attention`` for the module (it folds
    ``_is_make_fx_tracing()`` to True), so the slow path that expand_mha opens is what runs."""
    for rank, r in enumerate(ranks.run(world, _run_eval, "mha", timeout=240)):
        assert "error" not in r, (rank, r)
        assert r["fast_path"] == 0 and r["mha_traced"] == 1, (rank, r)
        assert r["err"] <= TOL, (rank, r)
        assert r["rings"] == [(False, False)] and r["whole"] == [] and r["fallbacks"] == [], (rank, r)
        assert not r["ring_mismatches"], (rank, r["ring_mismatches"])
        assert r["q_rows"] == [SEQ // world], (rank, r)


def test_native_multi_head_attention_called_directly(ranks) -> None:
    """The op itself in the graph: opened into SDPA; its weights used: refused, naming op, line and fix."""
    for rank, r in enumerate(ranks.run(2, _run_eval, "native", timeout=240)):
        assert "error" not in r, (rank, r)
        assert r["err"] <= TOL and r["rings"] == [(False, False)] and r["whole"] == [], (rank, r)
        assert not r["ring_mismatches"], (rank, r["ring_mismatches"])
    for r in ranks.run(2, _run_eval, "native_weights", timeout=240):
        error = r.get("error", "")
        assert "_native_multi_head_attention" in error and "need_weights" in error, r
        assert "test_mha.py:" in error and "Fix:" in error, r
