"""Hugging Face MPT and BLOOM, eager attention: ALiBi in their own forms, exact on 2 and 4 ranks
(issue 25 items 1 and 2).

MPT adds a per-key bias ``slope · (j - (L - 1))`` built once for ``max_seq_len`` and sliced to
the last S keys, then fills HF's boolean causal mask; it once ran with that bias read as a
boolean mask (gradients off by 40-90 %, no warning). BLOOM writes its scores as
``alibi.baddbmm(q, kᵀ, beta, alpha)`` on (B·H, S, S) and was not recognised at all (every rank
ran the whole sequence, no warning), and wraps its GeLU in a custom autograd.Function. Both are
called as users call them, ``model(input_ids=ids, labels=ids)``: the labels are the ids
themselves (Dynamo passes one tensor), which HF pads and shifts inside the model.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from checks import AttentionCount, cp_compile_warnings, grad_errors, rel, ring_mismatches

TOL = 1e-5


def _model(family: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if family == "mpt":
        cfg = transformers.MptConfig(vocab_size=128, n_layers=2, n_heads=4, d_model=64, max_seq_len=512)
        cls = transformers.MptForCausalLM
    else:
        cfg = transformers.BloomConfig(vocab_size=128, n_layer=2, n_head=4, hidden_size=64)
        cls = transformers.BloomForCausalLM
    cfg._attn_implementation = "eager"
    return cls(cfg).float().train()


def _compare(family: str) -> dict:
    ref_model, cp_model = _model(family), _model(family)
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    with AttentionCount() as count:
        ref = ref_model(input_ids=ids, labels=ids, use_cache=False)
    ref.loss.backward()
    backend = cp_compile.RingCP(inner="aot_eager")
    with cp_compile_warnings() as warnings, torch._dynamo.config.patch(specialize_float=True):
        out = torch.compile(cp_model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "grads": grad_errors(cp_model, ref_model),
            "rings": ring_mismatches(backend, count.calls), "fallbacks": list(backend.fallbacks),
            "masks": [m for r in backend.records for m in r.masks], "warnings": warnings}


@pytest.mark.slow
@pytest.mark.parametrize("world,family", [(2, "mpt"), (4, "mpt"), (2, "bloom"), (4, "bloom")])
def test_alibi_families_are_exact_ring_attention(ranks, world: int, family: str) -> None:
    for rank, r in enumerate(ranks.run(world, _compare, family, timeout=300)):
        worst = max(r["grads"], key=r["grads"].get)
        assert r["loss"] <= TOL and r["grads"][worst] <= TOL, (rank, r["loss"], worst, r["grads"][worst])
        assert not r["rings"] and r["fallbacks"] == [] and r["warnings"] == [], (rank, r)
        # causality stays the ring's flag; the bias is a score rule of global positions, no mask tensor
        assert r["masks"] and all(m.startswith("causal + score_mod") for m in r["masks"]), (rank, r["masks"])
