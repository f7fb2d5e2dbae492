"""Hugging Face ``transformers`` causal LMs, unmodified, through the ring_cp backend.

Each rank builds the same tiny random model twice from one seed (examples/hf_models.py):
one copy runs eagerly on the full sequence (the single-device reference), the other is
compiled with ``backend="ring_cp"`` and runs context-parallel. The model is called the
way users call it, ``model(input_ids=..., labels=...)``: Hugging Face's ForCausalLMLoss
shifts the labels inside the graph (``pad(labels, (0, 1), -100)[..., 1:]``), and the loss
and every parameter gradient must equal the reference (fp32, relative error <= 1e-5; each
gradient relative to its own norm but those zero in exact arithmetic, ``hf_models.ZERO_GRADS``),
with no op gathering the sequence and every attention of the eager run the ring.
"""

from __future__ import annotations


import pytest
import torch

import hf_models

import cp_compile
from checks import AttentionCount, explain_record, grad_errors, layout_mismatches, rel, ring_mismatches

TOL = 1e-5


def _summary(backend: cp_compile.RingCP, attentions: int) -> dict:
    """What of "every attention (``attentions`` calls a forward, counted in the eager run) became the
    ring in every graph compiled" fails, and fallbacks (ops run on the gathered sequence; outputs
    such as the logits are gathered at the end, as the uncompiled model returns them whole)."""
    return {"rings": ring_mismatches(backend, attentions, compiles=len(backend.graphs)),
            "fallbacks": len(backend.fallbacks), "graphs": len(backend.graphs)}


def _compare(family: str, seq_len: int, overrides: dict, options: dict, lengths: tuple = ()) -> dict:
    """On every rank: loss, logits and worst gradient relative errors of ring_cp against one process.

    ``lengths``: compile with ``dynamic=True`` and run these sequence lengths too (errors: the worst).
    """
    ref_model, cp_model = (hf_models.hf_model(family, **overrides) for _ in range(2))
    backend = cp_compile.RingCP(inner="aot_eager", **options)
    with torch._dynamo.config.patch(specialize_float=True):  # attention_dropout stays a constant 0.0
        ids, labels = hf_models.hf_tokens(seq_len)
        explained = None if lengths else explain_record(ref_model, (), {"input_ids": ids, "labels": labels},
                                                        world_size=torch.distributed.get_world_size(), **options)
        compiled = torch.compile(cp_model, backend=backend, fullgraph=True, dynamic=True if lengths else None)
        errs = [_one_length(ref_model, cp_model, compiled, s, hf_models.ZERO_GRADS.get(family, ()))
                for s in (seq_len, *lengths)]
    if explained is not None:  # explain (static shapes) says what the runtime did
        assert backend.records == [explained], (backend.records, explained)
    worst = {k: max(e[k] for e in errs) for k in ("loss", "grad", "logits")}
    layout = [m for e in errs for m in e["layout"]]
    return {**worst, "worst": [e["worst"] for e in errs], "layout": layout,
            **_summary(backend, errs[0]["attentions"])}


def _one_length(ref_model, cp_model, compiled, seq_len: int, zero: tuple) -> dict:
    """Errors at one length (``zero``: gradients zero in exact arithmetic), and the eager run's attention calls."""
    ids, labels = hf_models.hf_tokens(seq_len)
    for m in (ref_model, cp_model):
        m.zero_grad(set_to_none=True)
    with AttentionCount() as count:
        ref = ref_model(input_ids=ids, labels=labels)
    ref.loss.backward()
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = grad_errors(cp_model, ref_model, zero)
    worst = max(grads, key=grads.get)
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "grad": grads[worst], "worst": worst,
            "logits": rel(out.logits.detach(), ref.logits.detach()), "layout": layout_mismatches(out, ref),
            "attentions": count.calls}


def _check(results: list) -> None:
    for rank, r in enumerate(results):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["logits"] <= TOL, (rank, r)
        assert r["fallbacks"] == 0, (rank, r)
        assert not r["layout"], (rank, r["layout"])  # every output strided as the uncompiled model's
        assert not r["rings"], (rank, r["rings"])  # every attention became the ring, in every graph


# family, config overrides: what each case exercises (tiny configs in examples/hf_models.py).
# GPT-2 runs below under dynamic shapes. Qwen3, Gemma, Phi-3 and OLMo-2 were measured exact
# the same way (_compare); the file keeps to a few families so that it runs in about a minute.
CASES = [
    ("llama", {}),  # RoPE from inv_freq * position_ids, GQA, KV-cache concat (the cache is returned whole)
    ("qwen2", {}),  # q/k/v biases
    ("phi", {}),  # partial rotary, parallel attention/MLP block, biases everywhere
    ("gpt_neox", {}),  # fused QKV projection, rotary on part of the head
    ("opt", {}),  # learned positions with an offset, from a cumsum of the (all-ones) mask in the graph
    ("gemma3", {"sliding_window": 16, "use_cache": False}),  # sliding-window mask -> ring window, softcapping
    # A mask built in the graph: packed-sequence ids (cumsum of diff of position_ids) and a
    # sliding window as long as the sequence, recognised as causal and never materialised.
    ("mistral", {"sliding_window": 64, "use_cache": False}),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", CASES, ids=[c[0] for c in CASES])
def test_hf_causal_lm_is_exact_on_two_ranks(ranks, family: str, overrides: dict) -> None:
    _check(ranks.run(2, _compare, family, 64, overrides, {}, timeout=240))


@pytest.mark.slow
def test_hf_gpt2_dynamic_lengths(ranks) -> None:
    """dynamic=True: the symbolic graph serves S = 64 and 50 (padded); ``view(torch.Size([...]))``
    in GPT-2's Conv1D carries the symbolic sizes."""
    results = ranks.run(2, _compare, "gpt2", 64, {}, {}, (50,), timeout=240)
    _check(results)
    assert all(r["graphs"] <= 2 for r in results), results  # as for the example models (test_backend)


@pytest.mark.slow
def test_hf_sliding_window_shorter_than_the_sequence(ranks) -> None:
    """Mistral, window 16 of S = 64: the graph-built mask becomes the ring op's window; exact."""
    _check(ranks.run(2, _compare, "mistral", 64, {"sliding_window": 16, "use_cache": False}, {}, timeout=240))


def _gpt2_as_users_call_it(seq_len: int) -> dict:
    """GPT2LMHeadModel as a user builds it (no loss_type set: HF logs a warning inside forward,
    a graph break before the loss), compiled without fullgraph, called with ``labels=``: the
    frame after the break views the logits the first graph returned."""
    import transformers

    torch._dynamo.reset()
    ref_model, cp_model = (_seeded(transformers.GPT2LMHeadModel, hf_models.hf_config("gpt2")) for _ in range(2))
    ids, _ = hf_models.hf_tokens(seq_len)
    backend = cp_compile.RingCP(inner="aot_eager")
    with AttentionCount() as count:
        ref = ref_model(input_ids=ids, labels=ids)
    ref.loss.backward()
    out = torch.compile(cp_model, backend=backend)(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = grad_errors(cp_model, ref_model, hf_models.ZERO_GRADS.get("gpt2", ()))
    return {"loss": rel(out.loss.detach(), ref.loss.detach()), "grad": max(grads.values()),
            "logits": rel(out.logits.detach(), ref.logits.detach()), "layout": layout_mismatches(out, ref),
            **_summary(backend, count.calls)}


def _seeded(cls, cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(cfg).float().train()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hf_gpt2_with_labels_across_a_graph_break(ranks, world: int) -> None:
    for rank, r in enumerate(ranks.run(world, _gpt2_as_users_call_it, 128, timeout=300)):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["logits"] <= TOL, (rank, r)
        assert not r["layout"], (rank, r["layout"])
        assert not r["rings"], (rank, r["rings"])  # both layers' attention became the ring


@pytest.mark.slow
def test_hf_llama_on_four_ranks_with_padding(ranks) -> None:
    """S = 60 does not divide by 2N = 8: the graph pads the sequence, and stays exact."""
    _check(ranks.run(4, _compare, "llama", 60, {}, {}, timeout=300))


# -- masks built in the graph, recognised structurally (no process group: cp_compile.tools.explain) --
class _MaskedAttention(torch.nn.Module):
    """One attention over x (B, S, 16) with a mask written the way Hugging Face builds it."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.proj, self.mask = torch.nn.Linear(16, 16), mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.proj(x).view(B, S, 2, 8).transpose(1, 2)  # (B, 2, S, 8)
        qi = torch.arange(S)[None, None, :, None] + 0  # (1, 1, S, 1)
        ki = torch.arange(S)[None, None, None, :] + 0  # (1, 1, 1, S)
        mask = {
            "causal": lambda: qi.new_ones((), dtype=torch.bool) & (ki <= qi),
            "causal_flipped": lambda: qi >= ki,
            "window_as_long_as_s": lambda: (ki > qi - S) & (ki <= qi),
            "full": lambda: (qi >= 0) & (ki >= 0),
            "window_4": lambda: (ki > qi - 4) & (ki <= qi),
        }[self.mask]()
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask.expand(B, -1, S, S))
        return out.sum()


@pytest.mark.parametrize("mask,causal", [("causal", True), ("causal_flipped", True),
                                         ("window_as_long_as_s", True), ("full", False)])
def test_graph_built_masks_become_the_ring_causal_flag(mask: str, causal: bool) -> None:
    from cp_compile.tools.explain import explain_model

    S = 32
    report = explain_model(_MaskedAttention(mask), (torch.randn(2, S, 16),), world_size=2)
    rings = [n for n in report.after.graph.nodes if "ring_attention_fwd" in str(n.target)]
    assert [n.args[3] for n in rings] == [causal] and "window" not in rings[0].kwargs
    for n in report.after.graph.nodes:  # the S x S mask is never built
        val = n.meta.get("val")
        assert not (isinstance(val, torch.Tensor) and list(val.shape).count(S) >= 2), n.format_node()


def test_sliding_window_mask_becomes_the_ring_window() -> None:
    """A causal window shorter than S is the ring op's ``window`` (0 <= q - kv < W)."""
    from cp_compile.tools.explain import explain_model

    report = explain_model(_MaskedAttention("window_4"), (torch.randn(2, 32, 16),), world_size=2)
    rings = [n for n in report.after.graph.nodes if "ring_attention_fwd" in str(n.target)]
    assert [(n.args[3], n.kwargs.get("window")) for n in rings] == [(True, 4)]


class _RopeMatmul(torch.nn.Module):
    """RoPE as older Hugging Face versions write it: ``inv_freq (B, 4, 1) @ position_ids (B, 1, S)``,
    with position_ids a model input (so it is sharded along with the tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        inv = self.inv_freq[None, :, None].expand(B, -1, 1)  # (B, 4, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)  # (B, S, 4)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, 8)
        q = self.proj(x).view(B, S, 2, 8).transpose(1, 2) * emb.cos()  # (B, 2, S, 8)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def test_rope_matmul_with_sharded_positions_needs_no_gather() -> None:
    from cp_compile.tools.explain import explain_model

    S = 32
    report = explain_model(_RopeMatmul(), (torch.randn(2, S, 16), torch.arange(S)[None].expand(2, -1)), world_size=2)
    assert sorted(report.shard_inputs.values()) == [1, 1] and report.fallbacks == [], report.fallbacks
