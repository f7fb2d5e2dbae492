"""Hugging Face ``MixtralForCausalLM`` at a tiny random config, unmodified (no downloads).

4 local experts, top-2, ``output_router_logits=True``: the returned ``.loss`` is the causal-LM
loss plus ``router_aux_loss_coef`` times HF's ``load_balancing_loss_func`` (assignment counts
by ``histc`` and router probabilities summed over the tokens of every layer, divided by the
token count). transformers 5 runs the experts with its default ``grouped_mm`` implementation:
the (token, slot) pairs sorted by expert (``torch.sort``), the token rows gathered by
``perm // top_k``, a grouped matmul per expert over the sorted rows (offsets from ``histc``
and ``cumsum`` of the counts), and the rows put back by the inverse permutation.
"""

from __future__ import annotations

import torch
from hf_models import LossOf

from . import BATCH, SEQ_LEN, Member

VOCAB = 101


def factory(seq_len: int = SEQ_LEN, seed: int = 0, **overrides):
    """(LossOf(MixtralForCausalLM), (input_ids, labels)): labels are the ids (HF shifts them), ~10% ignored."""
    import transformers
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    fields = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, num_local_experts=4,
                  num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                  attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = transformers.MixtralConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).float().train()
    # HF installs its router-logits capturing hooks on the first call, under a threading lock Dynamo
    # cannot enter (a graph break at the top); install them now, as a first eager call would
    maybe_install_capturing_hooks(model.model)
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, VOCAB, (BATCH, seq_len), generator=g)
    labels = input_ids.clone()
    labels[torch.rand(BATCH, seq_len, generator=g) < 0.1] = -100
    return LossOf(model), (input_ids, labels)  # LossOf: forward(input_ids, labels) -> .loss


MEMBER = Member("hf_mixtral", "HF MixtralForCausalLM (transformers' grouped_mm experts: sort by expert, "
                "grouped matmul, inverse permutation), router aux loss in .loss",
                factory, worlds=(4,))  # 2 ranks: tests/test_zoo_moe.py
