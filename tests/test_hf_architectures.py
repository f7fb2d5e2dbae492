"""Representative Hugging Face families of the architecture sweep, on 2 ranks.

``benchmarks/hf_sweep.py`` runs every model type of the installed transformers with a
causal-LM, masked-LM or sequence-classification class through ring_cp
(``examples/hf_architectures.py``: the type's default config shrunk by
``examples/hf_configs.py``, one training step against one process on the same random batch)
and writes ``docs/hf_sweep.md``. This file keeps about 20 families of it in CI, none of those
``tests/test_hf_models.py`` (llama, qwen2/3, mistral, gemma, gemma3, phi, phi3, olmo2, gpt2,
gpt_neox, opt) and ``tests/test_hf_alibi.py`` (bloom, mpt) already run, chosen for what they
exercise, each asserting the outcome it should have: "ring" (exact, every attention the ring,
no gather) unless the comment names the documented reason for another. Each group of families
runs in one ``ranks.run`` call, one family after another at S = 32, so that they share the rank
processes and their imports. The rules the sweep rests on (which head, the tiny config, the
classification) are checked here in one process.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_architectures as arch
import hf_configs as configs

SEQ_LEN = 32  # every family below works at 32 (the sweep runs 64); windows are 16, still shorter

# model type -> expected outcome: what the family exercises (its head is configs.architectures()'s:
# the causal LM if it has one, else the masked LM, else sequence classification).
FAST = {  # the fast tier's smoke: one family of each kind of outcome but gathers
    "biogpt": "ring",  # learned positions, scaled embeddings
    "modernbert": "ring",  # masked LM, local (window 16) and global layers, rotary
    "fnet": "no CP, warned",  # no attention at all (Fourier mixing): nothing to split, said with a WARNING
    "doge": "refused",  # a learned attention bias (the SDPA mask requires grad) is refused, naming the fix
}
# Over ~10 s a group on 2 busy cores: the slow tier (@pytest.mark.slow on test_slow_architecture_has_its_outcome).
SLOW = {
    "decoders": {
        "falcon": "ring",  # multi-query attention (1 KV head), parallel attention/MLP
        "gptj": "ring",  # eager attention written by hand, interleaved rotary on part of the head
        "gemma2": "ring",  # eager attention with soft-capped scores, sliding / full layers
        "cohere": "ring",  # parallel attention/MLP, interleaved rotary, logit scale
        "starcoder2": "ring",  # GQA (2 KV heads of 4) with biases, a sliding window (16)
        "stablelm": "ring",  # rotary on a quarter of the head
        "bart": "ring",  # the decoder of an encoder-decoder alone (BartForCausalLM), learned positions
        # Differential attention: two attention calls per layer, each the ring; its lambda gradients
        # cancel, and their error is the fp32 reference's own rounding (judged against fp64).
        "diffllama": "ring",
    },
    "encoders and limits": {
        "distilbert": "ring",  # masked LM, bidirectional
        # Position ids from a cumsum of the non-pad tokens: a scan over the sequence, by every rank's
        # run totals (rules/scans.py), no gather.
        "roberta": "ring",
        "lfm2": "ring",  # a hybrid: short causal convolutions (conv1d(x)[..., :S]: a halo exchange) and attention
        # RG-LRU written as a Python loop into a buffer (unrolled by Dynamo, folded back into one step,
        # state-passed in parallel) beside local attention
        "recurrent_gemma": "ring",
        "deberta": "no CP, warned",  # disentangled attention, a learned relative bias: left whole, warned
        "xglm": "no CP, warned",  # hand-written attention in a form ring_cp does not recognise, warned
        # Sequence classification over two lengths (characters, then every 4th): refused by name.
        "canine": "refused",
    },
    "mixtures of experts": {
        # MLA (low-rank K/V, V head dim != Q/K head dim); MoE, 4 experts top-2 and a shared expert,
        # with group-limited routing.
        "deepseek_v3": "ring",
        # Sequence classification: the last non-pad token, found by an argmax over the sequence
        # (each rank's candidates, finished over the ranks: rules/order.py), its logits read from the
        # rank holding the row (rules/getitem.py); MLA and MoE underneath.
        "mistral4": "ring",
    },
}


def _run_group(model_types: list) -> list:
    """On every rank: :func:`arch.run_architecture` of each type in turn, on the same ranks."""
    import transformers

    transformers.logging.set_verbosity_error()
    return [arch.run_architecture(t, seq_len=SEQ_LEN) for t in model_types]


def _check(ranks, expected: dict) -> None:
    """Every family of ``expected``, on 2 ranks in one call, merged over them, has its outcome."""
    per_rank = ranks.run(2, _run_group, list(expected), timeout=120 + 60 * len(expected))
    got = {}
    for results in zip(*per_rank):
        merged = arch.merge_ranks(list(results))
        got[merged["model_type"]] = arch.classify(merged)
    wrong = {t: got[t] for t in expected if got[t][0] != expected[t]}
    assert not wrong, "\n".join(f"{t}: expected {expected[t]}, got {o} ({m})" for t, (o, m) in wrong.items())


def test_architecture_has_its_outcome(ranks) -> None:
    _check(ranks, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("group", list(SLOW))
def test_slow_architecture_has_its_outcome(ranks, group: str) -> None:
    _check(ranks, SLOW[group])


def test_no_family_here_is_run_by_the_other_hf_tests() -> None:
    elsewhere = {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "gemma3_text", "phi", "phi3", "olmo2",
                 "gpt2", "gpt_neox", "opt", "bloom", "mpt"}
    here = [t for group in (FAST, *SLOW.values()) for t in group]
    assert len(here) == len(set(here)) and not elsewhere & set(here)


# -- the rules, in one process ------------------------------------------------------------------
@pytest.mark.slow
def test_one_row_per_model_type_preferring_causal_then_masked_lm() -> None:
    from transformers.models.auto import modeling_auto as m

    rows = configs.architectures()
    types = {*m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *m.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             *m.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}
    assert [r[0] for r in rows] == sorted(types)
    heads = {t: h for t, h, _ in rows}
    assert (heads["bert"], heads["distilbert"], heads["t5"]) == ("causal-lm", "masked-lm", "seq-cls")


def test_tiny_config_follows_the_field_names() -> None:
    gpt2 = configs.tiny_config("gpt2")  # n_embd, n_layer, ... are hidden_size, ... by its attribute_map
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions, gpt2.vocab_size) == (64, 2, 4, 256, 128)
    assert gpt2.resid_pdrop == gpt2.embd_pdrop == gpt2.attn_pdrop == gpt2.summary_first_dropout == 0
    assert gpt2.use_cache is False and gpt2.bos_token_id == gpt2.eos_token_id < configs.LOW_ID  # bos = eos kept
    t5 = configs.tiny_config("t5")
    assert (t5.d_model, t5.d_kv, t5.num_layers, t5.num_heads, t5.dropout_rate) == (64, 16, 2, 4, 0)
    mixtral = configs.tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.num_key_value_heads) == (4, 2, 2)
    assert mixtral.router_jitter_noise == 0
    gemma3 = configs.tiny_config("gemma3_text")
    assert gemma3.layer_types == ["sliding_attention", "full_attention"] and gemma3.sliding_window == 16
    assert configs.tiny_config("starcoder2").num_key_value_heads == 2  # GQA: 2 of 4


def test_special_tokens_are_never_drawn() -> None:
    cfg = configs.tiny_config("gemma3")  # image, boi, eoi placeholders; pad, bos, eos in its text config
    ids = [getattr(cfg, n) for n in ("image_token_index", "boi_token_index", "eoi_token_index")]
    ids += [getattr(cfg.text_config, n) for n in ("pad_token_id", "bos_token_id", "eos_token_id")]
    assert len(set(ids)) == len(ids) and not any(configs.LOW_ID <= i < configs.HIGH_ID for i in ids), ids
    batch = configs.make_batch("causal-lm", 64)["input_ids"]
    assert batch.min() >= configs.LOW_ID and batch.max() < configs.HIGH_ID


def test_attention_count_takes_sdpa_and_softmax_over_square_scores() -> None:
    from _exact import AttentionCount

    S = 8
    q = torch.randn(1, 2, S, 4)
    with AttentionCount() as count:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.softmax(q @ q.transpose(-1, -2), -1)  # scores (1, 2, S, S): attention by hand
        torch.softmax(torch.randn(1, S, 128), -1)  # over a vocabulary: not attention
        torch.log_softmax(torch.randn(1, S, S), -1)  # a loss
    assert count.calls == 2


def _ran(**kw) -> dict:
    base = {"status": "ran", "cp_error": None, "warnings": [], "gathers": [], "ring_ops": 2, "attentions": 2,
            "loss_error": 1e-7, "grad_errors": {"w": 1e-6}}
    return {**base, **kw}


_CRASH = {"refused": False, "line": "RuntimeError: view size is not compatible"}
_UNSPLIT = "cp_compile: attention that ring_cp cannot split, at m.py:9"


@pytest.mark.parametrize("result,outcome", [
    (_ran(), "ring"),
    (_ran(gathers=["cp_compile: cumsum at m.py:3"], warnings=["cp_compile: cumsum at m.py:3; gathering"]),
     "ring + gathers"),
    (_ran(gathers=["cp_compile: cumsum at m.py:3"]), "silent"),
    (_ran(ring_ops=0, warnings=[_UNSPLIT]), "no CP, warned"),
    (_ran(ring_ops=1), "silent"),
    (_ran(ring_ops=0, attentions=0), "silent"),  # no attention at all, and no WARNING
    (_ran(ring_ops=0, attentions=0, recurrences=2), "sharded"),  # no attention; its recurrences split
    (_ran(ring_ops=0, attentions=0, recurrences=1, gathers=["cp_compile: sort at m.py:4"],
          warnings=["cp_compile: sort at m.py:4; gathering"]), "sharded + gathers"),
    (_ran(ring_ops=0, attentions=0, recurrences=1, gathers=["cp_compile: sort at m.py:4"]), "silent"),
    (_ran(grad_errors={"w": 2e-5}), "wrong"),
    (_ran(grad_errors={"w": math.inf}), "wrong"),  # a gradient on one side only
    (_ran(loss_error=math.nan), "wrong"),
    (_ran(cp_error={"refused": True, "line": "CPRewriteError: ... Fix: ..."}), "refused"),
    (_ran(cp_error=_CRASH, plain_compile=None), "crash"),  # compiles without ring_cp: ours
    (_ran(cp_error=_CRASH), "crash"),  # not tried (a worker's own error)
    (_ran(cp_error=_CRASH, plain_compile=_CRASH["line"]), "compile fails without ring_cp"),
    ({"status": "not built", "error": "ImportError: needs timm"}, "not built"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_classify(result: dict, outcome: str) -> None:
    assert arch.classify(result)[0] == outcome
    assert outcome in (*arch.OUTCOMES, *arch.SKIPPED)


def test_no_cp_names_the_warning_that_said_so() -> None:
    gather = "cp_compile: cumsum at m.py:3; gathering the full sequence"
    result = _ran(ring_ops=0, gathers=["cp_compile: cumsum at m.py:3"],
                  warnings=["cp_compile: other", gather, _UNSPLIT])
    assert arch.classify(result) == ("no CP, warned", _UNSPLIT) and arch.no_cp_warning(result) == _UNSPLIT


def test_a_refusal_wrapped_by_dynamo_is_a_refusal() -> None:
    from cp_compile.errors import CPRewriteError

    try:
        try:
            raise CPRewriteError("cp_compile: cross-attention at m.py:4. Fix: ...")
        except CPRewriteError as inner:
            raise RuntimeError("backend='RingCP' raised:") from inner
    except RuntimeError as e:
        error = arch.describe_error(e)
    assert error["refused"] and error["line"].startswith("CPRewriteError: cp_compile: cross-attention"), error
    assert not arch.describe_error(KeyError("x"))["refused"]
