"""Hugging Face ``transformers`` decoder models at tiny random configs, built in code.

No downloads: each family's config class is filled with a tiny shape (hidden 64,
2 layers, 4 heads / 2 KV heads where the family has GQA, vocab 128) and the model
is initialised from ``seed``, so every process builds the same weights. The models
are the library's own classes, unmodified, with ``attn_implementation="sdpa"`` and
dropout off; they are what the ``ring_cp`` backend must make context-parallel.

    model, (input_ids, labels) = hf_factory("llama", seq_len=64)
    loss = model(input_ids, labels)           # LossOf: HF shifts labels inside
    out = model.lm(input_ids=input_ids, labels=labels)   # the HF model itself

``cp-compile explain examples/hf_models.py:hf_factory`` shows the rewrite of the
Llama; ``hf_family_factory("mistral")`` returns a factory for another family.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn
from torch import Tensor

VOCAB = 128

# family -> (config class, model class, config fields beyond the common tiny ones)
FAMILIES: Dict[str, Tuple[str, str, Dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 16}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "opt": ("OPTConfig", "OPTForCausalLM", {}),
}

# family -> parameters (name suffixes) whose gradient is zero in exact arithmetic (examples/_exact.py):
# a key projection's bias where nothing rotates the keys (OPT's learned positions are added to the
# embeddings): q . b_k shifts a whole row of scores, which softmax ignores. Not Qwen2's or Phi's
# k_proj.bias, which (partial) RoPE rotates by key position; not a fused QKV bias (GPT-2, GPT-NeoX),
# whose query and value parts are not zero. Checked in fp64: these have ||g|| ~1e-19 of the whole.
ZERO_GRADS: Dict[str, Tuple[str, ...]] = {"opt": ("k_proj.bias",)}

_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
# Families whose config names differ from the Llama-style ones.
_RENAMED = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=VOCAB, n_inner=128,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=VOCAB, max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=256, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0),
    "phi": dict(_COMMON, num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
}


class LossOf(nn.Module):
    """``forward(input_ids, labels) -> loss`` of a Hugging Face causal LM (for ``cp-compile``).

    ``labels`` are the unshifted token ids (``-100`` = ignored): the HF loss
    (``ForCausalLMLoss``) shifts them inside the model.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


def hf_config(family: str, **overrides: Any) -> Any:
    """The tiny config of ``family`` (a key of FAMILIES), sdpa attention, fp32, no dropout."""
    import transformers

    cfg_name, _, extra = FAMILIES[family]
    fields = {**_TOKENS, **_RENAMED.get(family, _COMMON), **extra, **overrides}
    return getattr(transformers, cfg_name)(attn_implementation="sdpa", **fields)


def hf_model(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """The family's causal LM from :func:`hf_config`, initialised from ``seed`` (train mode)."""
    import transformers

    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(cfg).float()
    if getattr(model, "loss_type", None) is None:  # GPT2LMHeadModel: HF would log a warning inside
        model.loss_type = "ForCausalLM"  # forward (a graph break) before using this same loss
    return model.train()


def hf_tokens(seq_len: int, batch: int = 2, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` (B, S): labels are the ids, unshifted, with ~10% set to -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch, seq_len, generator=g) < 0.1] = -100
    return ids, labels


def hf_factory(seq_len: int = 64, batch: int = 2, seed: int = 0, family: str = "llama",
               **overrides: Any) -> Tuple[LossOf, Tuple[Tensor, Tensor]]:
    """``(LossOf(model), (input_ids, labels))`` for ``family`` (default: Llama)."""
    return LossOf(hf_model(family, seed, **overrides)), hf_tokens(seq_len, batch, seed)


def hf_family_factory(family: str) -> Callable[..., Tuple[LossOf, Tuple[Tensor, Tensor]]]:
    """A factory like :func:`hf_factory` fixed to ``family`` (for ``cp-compile`` TARGETs)."""
    def factory(seq_len: int = 64, batch: int = 2, seed: int = 0, **overrides: Any):
        return hf_factory(seq_len, batch, seed, family, **overrides)
    factory.__name__ = f"hf_{family}_factory"
    return factory


for _fam in FAMILIES:  # hf_llama_factory, hf_mistral_factory, ... as module attributes
    globals()[f"hf_{_fam}_factory"] = hf_family_factory(_fam)
