"""A T5-style encoder: a learned, bucketed relative-position bias instead of position embeddings.

Written the way Hugging Face's ``modeling_t5`` writes it: ``T5LayerNorm`` (RMS, no mean, no bias),
no 1/√d scaling of the scores, the bias computed once, in the first layer's attention, from a learned
``(num_buckets, H)`` table looked up at the bucket of ``k − q`` (bidirectional: the sign gets half the
buckets, small distances one bucket each, larger ones logarithmic bins up to ``max_distance``), the
padding mask ``(1 − mask) · finfo.min`` added to it, and the result passed on to every later layer
(``scores += position_bias``). Under ``ring_cp`` the bias becomes a score rule of global positions
whose table is a score buffer that trains (its gradient comes back from the ring's backward); the
padding stays a (B, 1, 1, S) key row; no S x S or c x S tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class T5LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class T5Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, has_bias: bool, num_buckets: int = 16, max_distance: int = 32) -> None:
        super().__init__()
        self.n_heads, self.d_kv = n_heads, dim // n_heads
        self.num_buckets, self.max_distance, self.has_bias = num_buckets, max_distance, has_bias
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        if has_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )
        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets

    def compute_bias(self, query_length: int, key_length: int, device=None) -> torch.Tensor:
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position  # (S, S)
        bucket = self._relative_position_bucket(relative_position, bidirectional=True,
                                                num_buckets=self.num_buckets, max_distance=self.max_distance)
        values = self.relative_attention_bias(bucket)  # (S, S, H)
        return values.permute([2, 0, 1]).unsqueeze(0)  # (1, H, S, S)

    def forward(self, hidden_states, mask=None, position_bias=None):
        b, s = hidden_states.shape[:2]
        shape = lambda x: x.view(b, -1, self.n_heads, self.d_kv).transpose(1, 2)  # noqa: E731
        q, k, v = shape(self.q(hidden_states)), shape(self.k(hidden_states)), shape(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(3, 2))  # no 1/sqrt(d): T5 folds it into the initialisation
        if position_bias is None:
            position_bias = self.compute_bias(s, s, device=scores.device)
            if mask is not None:
                position_bias = position_bias + mask  # (B, H, S, S)
        scores += position_bias
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn_weights, v).transpose(1, 2).contiguous().view(b, -1, self.n_heads * self.d_kv)
        return self.o(out), position_bias


class T5Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, has_bias: bool, ffn: int) -> None:
        super().__init__()
        self.attn_norm, self.ff_norm = T5LayerNorm(dim), T5LayerNorm(dim)
        self.SelfAttention = T5Attention(dim, n_heads, has_bias)
        self.wi, self.wo = nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False)

    def forward(self, x, mask, position_bias):
        out, position_bias = self.SelfAttention(self.attn_norm(x), mask, position_bias)
        x = x + out
        return x + self.wo(F.relu(self.wi(self.ff_norm(x)))), position_bias


class T5Encoder(nn.Module):
    """Embeddings, blocks (the first owns the relative bias), a final RMS norm, a token-level head."""

    def __init__(self, vocab: int, dim: int, n_heads: int, n_layers: int, ffn: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.block = nn.ModuleList(T5Block(dim, n_heads, i == 0, ffn) for i in range(n_layers))
        self.final_layer_norm = T5LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        extended = attention_mask[:, None, None, :].to(x.dtype)  # (B, 1, 1, S)
        extended = (1.0 - extended) * torch.finfo(x.dtype).min
        position_bias = None
        for layer in self.block:
            x, position_bias = layer(x, extended, position_bias)
        logits = self.head(self.final_layer_norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def factory(seq_len: int = SEQ_LEN, seed: int = 0, *, batch: int = BATCH, vocab: int = 101, dim: int = 32,
            n_heads: int = 4, n_layers: int = 2, ffn: int = 0):
    """(model, (input_ids, attention_mask, labels)): the last sequence of the batch padded at its end;
    ``ffn``: the MLP's width (default 2 · dim; T5 itself uses 4 · dim)."""
    torch.manual_seed(seed)
    model = T5Encoder(vocab, dim, n_heads, n_layers, ffn or 2 * dim)
    with torch.no_grad():  # a bias that matters: T5 initialises it as large as the unscaled scores
        model.block[0].SelfAttention.relative_attention_bias.weight.normal_(0.0, 1.0)
    input_ids = torch.randint(0, vocab, (batch, seq_len))
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    attention_mask[-1, seq_len - seq_len // 4:] = 0
    labels = torch.roll(input_ids, -1, dims=1).masked_fill(attention_mask == 0, -100)
    return model, (input_ids, attention_mask, labels)


MEMBER = Member("t5_encoder", "HF T5-style encoder: a learned bucketed relative bias (an (nb, H) table at the "
                "bucket of k − q) computed in layer 0 and reused, plus padding, added to unscaled hand-written "
                "scores -> a score rule whose table trains", factory)
