"""Packed documents in compiled graphs: document mask terms become the ring op's ``doc_ids``.

A mask term ``X[b, q] == X[b, kv]`` over per-position integer ids X (cp_compile/passes/analyze/masks/documents.py)
is handed to the ring op as the whole X (4-8 bytes a token) instead of c x S explicit rows per
rank. Each case compiles a model unchanged and compares, on N = 2 and 4 gloo ranks, its loss
and every parameter gradient with the same model run eagerly in one process on the full
sequence (fp32, relative error <= 1e-5); and checks every attention of that run became a ring
op (``checks.loss_through_ring_cp``), the ring op got ``doc_ids``, no tensor of
the rewritten graph is S wide per query row, nothing fell back to a gather, nothing warned, and
``cp-compile explain``'s record (mask forms included) is the runtime's:

- Hugging Face Llama called with ``position_ids`` restarting at each document (HF builds
  ``cumsum(diff(position_ids) != 1)`` ids and compares remapped positions): rows with
  different document counts, a document shorter than one rank's chunk, one longer than a
  rank's whole share; and with ``attention_mask`` padding (HF then drops packing: causal and
  key padding only, positions still restarting for RoPE);
- a hand-written model (examples/packed.py) taking document ids, ``doc[:, :, None] ==
  doc[:, None, :]`` (or the ``unsqueeze`` form) & causal, with and without key padding, and a
  length that needs padding; taking ``cu_seqlens`` (flash-attn varlen), ids from
  ``searchsorted``; taking token ids, ids from separator tokens (a sharded input read whole);
  ids computed from activations are refused.

Without a process group (cp_compile.tools.explain): two different document terms ANDed stay
explicit, as do ids that are not per position; Mistral's packed sliding window keeps its window.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import hf_models
from packed import LENGTHS, S, DocAttention, PackedLlama
from packed import doc_ids as _doc_ids
from packed import positions as _positions

from checks import cp_compile_warnings, grad_errors, loss_through_ring_cp, rel

TOL = 1e-5
RING = "ring_attention_fwd"


def _compare(ref_model: torch.nn.Module, cp_model: torch.nn.Module, inputs: tuple, seq: int = S) -> dict:
    """On a rank: errors of ring_cp vs the eager model, and what the rewritten graph gives the ring op."""
    import torch.distributed as dist

    with torch._dynamo.config.patch(specialize_float=True), cp_compile_warnings() as warnings:
        ref, out, backend = loss_through_ring_cp(ref_model, cp_model, inputs)
    grads = grad_errors(cp_model, ref_model)  # (the embedding has a gradient in form "eos" only)
    (gm,) = backend.graphs
    world = dist.get_world_size()
    s_pad = -(-seq // (2 * world)) * 2 * world  # zig-zag pads the sequence to a multiple of 2N
    c = s_pad // world
    rings = [n for n in gm.graph.nodes if RING in str(n.target)]
    wide = [n.name for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() >= 2 and tuple(n.meta["val"].shape[-2:]) in ((seq, seq), (c, s_pad), (c, seq))]
    return {"loss": rel(out.detach(), ref.detach()), "grad": max(grads.values()),
            "worst": max(grads, key=grads.get), "fallbacks": list(backend.fallbacks), "warnings": warnings,
            "doc_ids": [n.kwargs.get("doc_ids") is not None for n in rings],
            "attn_mask": [tuple(n.kwargs["attn_mask"].meta["val"].shape) if "attn_mask" in n.kwargs else None
                          for n in rings],
            "wide": wide, "masks": backend.records[0].masks}


def _check(results: list, docs: bool, attn_mask: Optional[tuple] = None, layers: int = 2) -> None:
    for rank, r in enumerate(results):
        assert r["loss"] <= TOL and r["grad"] <= TOL, (rank, r)
        assert not r["fallbacks"] and not r["warnings"], (rank, r["fallbacks"], r["warnings"])
        assert r["doc_ids"] == [docs] * layers, (rank, r)
        assert r["attn_mask"] == [attn_mask] * layers, (rank, r)  # None: no explicit rows at all
        assert not r["wide"], (rank, r["wide"])  # no S x S and no c x S tensor survives the rewrite
        assert len(r["masks"]) == layers and all(("documents" in m) == docs for m in r["masks"]), r["masks"]


def _hf_case(padded: bool) -> dict:
    ids, labels = hf_models.hf_tokens(S)
    inputs = (ids, labels, _positions(LENGTHS))
    if padded:
        keep = torch.ones(2, S, dtype=torch.long)
        keep[1, -7:] = 0  # right padding of row 1
        inputs += (keep,)
    return _compare(PackedLlama(), PackedLlama(), inputs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hf_llama_packed_position_ids_give_the_ring_document_ids(ranks, world: int) -> None:
    results = ranks.run(world, _hf_case, False, timeout=300)
    _check(results, docs=True)
    assert results[0]["masks"][0] == "causal + documents; per rank: doc_ids (2, 96) int64 1.5 KiB", results[0]


@pytest.mark.slow
def test_hf_llama_packed_with_padding(ranks) -> None:
    """attention_mask given: HF applies no document mask (only RoPE sees the restarting positions)."""
    _check(ranks.run(2, _hf_case, True, timeout=300), docs=False, attn_mask=(2, 1, 1, S))


def _hand_case(form: str, padded: bool, seq: int = S) -> dict:
    torch.manual_seed(1)
    x = torch.randn(2, seq, 16)
    lengths = [row[:-1] + [row[-1] - (S - seq)] for row in LENGTHS]  # the last documents shortened
    doc = torch.tensor([0, 5, 63, seq]) if form == "cu_seqlens" else _doc_ids(lengths)
    if form == "eos":
        doc = torch.randint(0, 8, (2, seq), generator=torch.Generator().manual_seed(2))
    inputs = (x, doc)
    if padded:
        keep = torch.ones(2, seq, dtype=torch.bool)
        keep[1, -7:] = False  # inside row 1's last document, so no query loses every key
        inputs += (keep,)
    return _compare(DocAttention(form), DocAttention(form), inputs, seq)


@pytest.mark.slow
@pytest.mark.parametrize("world,form,padded,seq", [(2, "index", False, S), (4, "index", True, S),
                                                   (2, "unsqueeze", True, S), (4, "cu_seqlens", False, S),
                                                   (2, "eos", False, S), (4, "index", True, 90),
                                                   (4, "head_dim_last", True, S)])
def test_hand_written_document_masks(ranks, world: int, form: str, padded: bool, seq: int) -> None:
    """S = 90 on 4 ranks pads to 96: the ids cover the 90 real positions, the ring skips the padding."""
    s_pad = -(-seq // (2 * world)) * 2 * world
    _check(ranks.run(world, _hand_case, form, padded, seq, timeout=240), docs=True,
           attn_mask=(2, 1, 1, s_pad) if padded else None)  # key padding only: one row for every query


# -- structure only, no process group -------------------------------------------------------------
class _Two(torch.nn.Module):
    """One attention whose mask ANDs two different document terms, or compares non-per-position ids."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, S, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.kind == "two":
            mask = (a[:, :, None] == a[:, None, :])[:, None] & (b[:, :, None] == b[:, None, :])[:, None]
        else:  # b (B, S, S) is no per-position tensor
            mask = b[:, None] == b[:, None].transpose(-1, -2)  # (B, 1, S, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("kind", ["two", "not_per_position"])
def test_other_equalities_stay_explicit(kind: str) -> None:
    from cp_compile.tools.explain import explain_model

    x, a = torch.randn(2, S, 16), _doc_ids(LENGTHS)
    b = _doc_ids([[50, 46], [10, 86]]) if kind == "two" else torch.randint(0, 3, (2, S, S))
    torch._dynamo.reset()
    rec = explain_model(_Two(kind), (x, a, b), world_size=2).ctx.record
    assert rec.masks and all(m.startswith("explicit;") for m in rec.masks), rec.masks


def test_document_ids_from_activations_are_refused() -> None:
    from cp_compile.errors import CPRewriteError
    from cp_compile.tools.explain import explain_model

    torch._dynamo.reset()
    with pytest.raises(CPRewriteError, match=r"document ids .*examples/packed.py:\d+.*Fix: compute the document ids"):
        explain_model(DocAttention("activations"), (torch.randn(2, S, 16), _doc_ids(LENGTHS)), world_size=2)


@pytest.mark.slow
def test_hf_mistral_packed_sliding_window_keeps_its_window() -> None:
    """HF's remapped ``position_ids[b, kv] > position_ids[b, q] - W`` inside documents: the ring's window."""
    from cp_compile.tools.explain import explain_model
    from cp_compile.tools.explain_format import format_explain

    class Packed(PackedLlama):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.lm = hf_models.hf_model("mistral", sliding_window=16, use_cache=False)

    torch._dynamo.reset()
    ids, labels = hf_models.hf_tokens(S)
    with torch._dynamo.config.patch(specialize_float=True):
        report = explain_model(Packed(), (ids, labels, _positions(LENGTHS)), world_size=2)
    rec = report.ctx.record
    assert rec.masks == ["causal + window 16 + documents; per rank: doc_ids (2, 96) int64 1.5 KiB"] * 2, rec.masks
    assert not rec.fallbacks, rec.fallbacks
    text = format_explain(report)  # what `cp-compile explain` prints: the record's form, per attention
    assert text.count("mask: causal, window 16 by position, documents by their ids (no mask tensor)") == 2, text
    assert text.count(f"mask form: {rec.masks[0]}") == 2, text
