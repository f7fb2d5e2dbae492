"""Attention masks through the ring_cp backend: exact against one process, and never S x S whole.

A mask is split (cp_compile/passes/analyze/masks/classify.py) into what the ring op does by position
(causal, full, a causal sliding window) and explicit terms, of which each rank builds
only its own query rows (passes/masks/rows.py). Each case compiles a model unchanged and
compares, on 2 gloo ranks, its loss and every parameter gradient with the same model
run eagerly in one process on the full sequence (fp32, relative error <= 1e-5), and
checks that every attention of that run became the ring:

- masks written in the model: a key-padding mask from a model input (Hugging Face's
  form), a band with no upper bound, a 0/1 float mask, a mask passed in as a bool or an
  additive (finfo.min) tensor, a bidirectional window, and a sequence length that needs
  padding;
- Hugging Face Llama and Mistral (sliding window) called with ``attention_mask`` holding
  left or right padding, as a batch of different lengths is.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import hf_models

import cp_compile
from checks import (AttentionCount, MaskedAttention, explain_record, grad_errors, layout_mismatches, masked_inputs,
                    rel, ring_mismatches)

TOL = 1e-5
B, D = 2, 16


def _rank_masked(kind: str, S: int, dynamic: bool = False) -> dict:
    """Errors of ring_cp against one process; ``dynamic``: one graph for S and S - 2 (padded)."""
    model = kind.replace("_additive", "")
    ref_model, cp_model = MaskedAttention(model), MaskedAttention(model)
    explained = explain_record(ref_model, (), masked_inputs(kind, S), world_size=2, dynamic=dynamic)
    backend = cp_compile.RingCP(inner="aot_eager")
    compiled = torch.compile(cp_model, backend=backend, fullgraph=True, dynamic=dynamic or None)
    loss_err = grad_err = 0.0
    for length in ((S, S - 2) if dynamic else (S,)):
        inputs = masked_inputs(kind, length)
        for m in (ref_model, cp_model):
            m.zero_grad(set_to_none=True)
        with AttentionCount() as count:
            ref = ref_model(**inputs)
        ref.backward()
        loss = compiled(**inputs)
        loss.backward()
        grad_err = max([grad_err, *grad_errors(cp_model, ref_model).values()])
        loss_err = max(loss_err, rel(loss.detach(), ref.detach()))
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    return {"loss": loss_err, "grad": grad_err, "fallbacks": len(backend.fallbacks), "graphs": len(backend.graphs),
            "rings": _rings(backend), "ring_mismatches": ring_mismatches(backend, count.calls)}


def _rings(backend: cp_compile.RingCP) -> list:
    """The (causal, window, explicit mask given) of every ring op of the rewritten graphs."""
    rings = [n for gm in backend.graphs for n in gm.graph.nodes if "ring_attention_fwd" in str(n.target)]
    return [(n.args[3], n.kwargs.get("window", -1), "attn_mask" in n.kwargs) for n in rings]


# kind, S, the ring op's (causal, window, explicit mask) for it
MODEL_CASES = [
    ("causal_padding", 32, (True, -1, True)),  # key padding from an input: causal kept, (B, 1, 1, S) rows
    ("causal_padding", 30, (True, -1, True)),  # S = 30 is padded to 32 by the rewrite
    ("no_upper_bound", 32, (False, -1, False)),  # functions of positions: a mask_mod (masks/lift.py)
    ("bidirectional_window", 32, (False, -1, False)),
    ("float", 32, (False, -1, False)),  # ... and a score_mod
    ("given", 32, (False, -1, True)),
    ("given_additive", 32, (False, -1, True)),
]


@pytest.mark.parametrize("kind,S,ring", MODEL_CASES, ids=[f"{c[0]}-{c[1]}" for c in MODEL_CASES])
def test_masks_in_the_model_are_exact(ranks, kind: str, S: int, ring: tuple) -> None:
    for rank, r in enumerate(ranks.run(2, _rank_masked, kind, S, timeout=120)):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert r["fallbacks"] == 0 and r["rings"] == [ring, ring] and not r["ring_mismatches"], (rank, r)


def _rank_hf_padded(family: str, side: str, overrides: dict) -> dict:
    """HF ``model(input_ids, attention_mask, labels)`` with row 0 padded on ``side``."""
    S = 64
    ids, labels = hf_models.hf_tokens(S)
    attention_mask = torch.ones_like(ids)
    pad = slice(0, 9) if side == "left" else slice(S - 9, S)
    attention_mask[0, pad] = 0
    labels[0, pad] = -100
    ref_model, cp_model = (hf_models.hf_model(family, **overrides) for _ in range(2))
    kwargs = {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}
    with torch._dynamo.config.patch(specialize_float=True):  # as in tests/test_hf_models.py
        explained = explain_record(ref_model, (), kwargs, world_size=2)
    with AttentionCount() as count:
        ref = ref_model(**kwargs)
    ref.loss.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    with torch._dynamo.config.patch(specialize_float=True):
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(**kwargs)
    out.loss.backward()
    assert backend.records == [explained], (backend.records, explained)  # explain says what the runtime did
    grad = max(grad_errors(cp_model, ref_model, hf_models.ZERO_GRADS.get(family, ())).values())
    real = attention_mask.bool()[..., None]  # logits of padding tokens are not compared (no label uses them)
    logits = rel(out.logits.detach() * real, ref.logits.detach() * real)
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "grad": grad, "logits": logits,
            "fallbacks": len(backend.fallbacks), "finite": bool(torch.isfinite(ref.logits).all()),
            "layout": layout_mismatches(out, ref), "rings": _rings(backend),
            "ring_mismatches": ring_mismatches(backend, count.calls)}


@pytest.mark.slow
@pytest.mark.parametrize("family,side,overrides,window", [
    ("llama", "right", {}, -1),
    ("llama", "left", {}, -1),
    ("mistral", "left", {"sliding_window": 16, "use_cache": False}, 16),  # window + padding together
], ids=["llama-right", "llama-left", "mistral-window-left"])
def test_hf_attention_mask_with_padding_is_exact(ranks, family: str, side: str, overrides: dict, window: int) -> None:
    """The mask keeps causal (and the window) by position; only the key padding is a tensor."""
    for rank, r in enumerate(ranks.run(2, _rank_hf_padded, family, side, overrides, timeout=240)):
        assert r["finite"], r  # the single-device reference itself is well defined
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["logits"] <= TOL, (rank, r)
        assert r["fallbacks"] == 0 and r["rings"] == [(True, window, True)] * 2, (rank, r)
        assert not r["ring_mismatches"], (rank, r["ring_mismatches"])
        assert not r["layout"], (rank, r["layout"])  # the logits strided as the uncompiled model's


# -- the rewrite alone (no process group: cp_compile.tools.explain) ------------------------
def _local_shapes(report) -> list:
    return [tuple(n.meta["val"].shape) for n in report.after.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]


@pytest.mark.parametrize("kind,largest", [("causal_padding", (1, 64)), ("query_key_padding", (32, 64))])
def test_no_rank_builds_more_of_a_mask_than_its_rows(kind: str, largest: tuple) -> None:
    """S = 64 on 2 ranks (c = 32): a key-padding mask stays (B, 1, 1, S); a mask that varies by
    query (read from an input: no rule of positions) is built as this rank's (c, S) rows, never (S, S)."""
    from cp_compile.tools.explain import explain_model

    inputs = masked_inputs(kind, 64)
    report = explain_model(MaskedAttention(kind), (inputs["x"], inputs["padding"]), world_size=2)
    mask_like = [s[-2:] for s in _local_shapes(report) if len(s) == 4 and s[-1] == 64]  # (B|1, H|1, rows, keys)
    assert mask_like and max(mask_like, key=lambda s: s[0] * s[1]) == largest, mask_like


class _LearnedBias(torch.nn.Module):
    def __init__(self, S: int) -> None:
        super().__init__()
        self.proj, self.bias = torch.nn.Linear(D, D), torch.nn.Parameter(torch.zeros(1, 1, S, S))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(B, x.shape[1], 2, D // 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=self.bias).sum()


def test_a_mask_that_needs_a_gradient_is_refused_with_line_and_fix() -> None:
    from cp_compile.tools.explain import explain_model
    from cp_compile.passes.context import CPRewriteError

    with pytest.raises(CPRewriteError) as err:
        explain_model(_LearnedBias(32), (torch.randn(B, 32, D),), world_size=2)
    text = str(err.value)
    assert "requires grad" in text and "test_backend_masks.py:" in text and "Fix:" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal_padding", "no_upper_bound"])
def test_masks_under_dynamic_shapes(ranks, kind: str) -> None:
    """dynamic=True: one graph serves S = 32 and 30 (padded); the mask rows are built from the
    symbolic length."""
    for rank, r in enumerate(ranks.run(2, _rank_masked, kind, 32, True, timeout=180)):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["fallbacks"] == 0, (rank, r)
        assert r["graphs"] == 1 and not r["ring_mismatches"], (rank, r)


@pytest.mark.slow
def test_an_s_by_s_mask_warns_once_naming_the_cheaper_form(caplog) -> None:
    """A mask that varies by query costs O(S^2 / N) per rank: one warning per process (then
    debug; tests/conftest.py resets the warnings before each test), naming the attention's source
    line and the cheaper forms; key padding warns not."""
    import logging

    from cp_compile.tools.explain import explain_model

    caplog.set_level(logging.DEBUG, logger="cp_compile")
    inputs = masked_inputs("causal_padding", 32)
    explain_model(MaskedAttention("causal_padding"), (inputs["x"], inputs["padding"]), world_size=2)
    given = masked_inputs("given", 32)["given"]  # an S x S mask passed in: no rule of positions
    for _ in range(2):
        explain_model(MaskedAttention("given"), (inputs["x"], None, given), world_size=2)
    about = [r for r in caplog.records if "explicit" in r.getMessage() and "query rows" in r.getMessage()]
    assert [r.levelname for r in about] == ["WARNING", "DEBUG"], [(r.levelname, r.getMessage()) for r in about]
    text = about[0].getMessage()
    assert "checks.py:" in text and "Cheaper: is_causal=True" in text and "(B, 1, 1, S)" in text, text
