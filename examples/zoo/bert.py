"""BERT (Hugging Face ``modeling_bert`` style) pre-training with masked-LM.

Word + position (``position_ids`` buffer sliced ``[:, :S]``) + token-type embeddings,
LayerNorm; the padding mask built as HF BERT builds its extended mask,
``(1 − mask[:, None, None, :]) · finfo.min`` (B, 1, 1, S); bidirectional attention
(heads split by ``view`` + ``permute``, SDPA with the additive mask), post-norm layers;
an MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings, own bias) and a
cross-entropy on ~15% of positions (labels −100 elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out, self.attn_norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate, self.output = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=1e-12)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size()[:-1] + (self.heads, self.head_size)).permute(0, 2, 1, 3)  # (B, H, S, hd)

    def forward(self, hidden_states: torch.Tensor, extended_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(f(hidden_states)) for f in (self.query, self.key, self.value))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=extended_mask)  # (B, H, S, hd)
        ctx = ctx.permute(0, 2, 1, 3).contiguous()
        ctx = ctx.view(ctx.size()[:-2] + (self.heads * self.head_size,))
        h = self.attn_norm(self.attn_out(ctx) + hidden_states)
        return self.out_norm(self.output(F.gelu(self.intermediate(h))) + h)


class BertForMaskedLM(nn.Module):
    def __init__(self, vocab_size: int = 101, hidden: int = 32, layers: int = 2, heads: int = 4,
                 intermediate: int = 128, max_position_embeddings: int = 128, type_vocab_size: int = 2) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden)
        self.register_buffer("position_ids", torch.arange(max_position_embeddings).expand((1, -1)), persistent=False)
        self.emb_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList([BertLayer(hidden, heads, intermediate) for _ in range(layers)])
        self.transform, self.transform_norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab_size)
        self.decoder.weight = self.word_embeddings.weight  # tied

    def forward(self, input_ids, attention_mask, token_type_ids, labels) -> torch.Tensor:
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = self.emb_norm(x + self.position_embeddings(position_ids))  # (B, S, D)
        dtype = x.dtype
        extended = attention_mask[:, None, None, :].to(dtype)  # (B, 1, 1, S)
        extended = (1.0 - extended) * torch.finfo(dtype).min
        for layer in self.layers:
            x = layer(x, extended)
        scores = self.decoder(self.transform_norm(F.gelu(self.transform(x))))  # (B, S, V)
        return F.cross_entropy(scores.view(-1, scores.size(-1)), labels.view(-1))  # ignore_index -100


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """Sentence pairs (token type 1 after a split point), 0/9/23 padded positions, ~15% masked."""
    torch.manual_seed(seed)
    model = BertForMaskedLM()
    lengths = torch.tensor([seq_len, seq_len - 9, seq_len - 23])
    pos = torch.arange(seq_len)[None, :]
    attention_mask = (pos < lengths[:, None]).long()  # (B, S) 1 = real token
    input_ids = torch.randint(5, 101, (BATCH, seq_len)) * attention_mask
    token_type_ids = (pos >= (lengths[:, None] // 2)).long() * attention_mask
    chosen = (torch.rand(BATCH, seq_len) < 0.15) & attention_mask.bool()
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    input_ids = input_ids.masked_fill(chosen, 4)  # [MASK]
    return model, {"input_ids": input_ids, "attention_mask": attention_mask,
                   "token_type_ids": token_type_ids, "labels": labels}


MEMBER = Member("bert", "HF BERT MLM: word + position_ids[:, :S] + token-type embeddings, "
                "(1-mask)*min padding mask, tied head",
                factory, zero_grads=("key.bias",))  # absolute positions: q . b_k shifts a row of scores
