"""BLOOM / MPT-style ALiBi: no position embeddings, a per-head linear bias on the attention scores.

The bias is built in ``forward`` from ``torch.arange`` the way BLOOM and MPT write it: per-head
slopes ``2^(-8/H · (h+1))`` (a registered buffer, or computed inline), times ``k − q`` (or BLOOM's
``k`` alone, softmax-equivalent), masked causally, added to the scores either through
``F.scaled_dot_product_attention(attn_mask=...)`` or by hand before the softmax. Under ``ring_cp``
the bias becomes a score rule of global positions in the ring op (no S x S or c x S tensor).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The standard geometric slopes (BLOOM's ``build_alibi_tensor`` for a power-of-2 head count)."""
    return torch.tensor([2 ** (-8 / n_heads * (h + 1)) for h in range(n_heads)])


class AlibiAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, *, causal: bool, form: str, slopes: str, bias: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.causal, self.form, self.slopes_from, self.bias_form = causal, form, slopes, bias
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)
        if slopes == "buffer":
            self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def alibi(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(1, H, S, S) additive bias, -inf above the diagonal when causal (built from positions)."""
        if self.slopes_from == "buffer":
            slopes = self.slopes
        else:  # inline, as MPT's gen_slopes does
            slopes = 2 ** (-8 / self.n_heads * torch.arange(1, self.n_heads + 1, device=device, dtype=torch.float32))
        pos = torch.arange(seq_len, device=device)
        rel = pos[None, :] - pos[:, None] if self.bias_form == "relative" else pos[None, :].expand(seq_len, -1)
        bias = slopes[:, None, None] * rel  # (H, S, S)
        if self.causal:
            bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        return bias[None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, S, D)
        out = self.attend(q, k, v)
        return self.dense(out.transpose(1, 2).reshape(b, s, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        alibi = self.alibi(q.shape[2], q.device)
        if self.form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + alibi
        return torch.softmax(scores, dim=-1) @ v


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, **attn) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attention = AlibiAttention(dim, n_heads, **attn)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class AlibiLM(nn.Module):
    """BLOOM-like decoder: word embeddings + embedding LayerNorm, ALiBi blocks, tied LM head."""

    def __init__(self, vocab: int, dim: int, n_heads: int, n_layers: int, **attn) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.word_embeddings_layernorm, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.h = nn.ModuleList(Block(dim, n_heads, **attn) for _ in range(n_layers))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.word_embeddings.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def factory(seq_len: int = SEQ_LEN, seed: int = 0, *, batch: int = BATCH, vocab: int = 101, dim: int = 32,
            n_heads: int = 4, n_layers: int = 2, causal: bool = True, form: str = "sdpa", slopes: str = "buffer",
            bias: str = "relative"):
    """(model, (input_ids, labels)); ``form`` "sdpa" | "scores" (hand-written), ``slopes`` "buffer" |
    "inline", ``bias`` "relative" (k − q) | "bloom" (k)."""
    torch.manual_seed(seed)
    model = AlibiLM(vocab, dim, n_heads, n_layers, causal=causal, form=form, slopes=slopes, bias=bias)
    input_ids = torch.randint(0, vocab, (batch, seq_len))
    return model, (input_ids, torch.roll(input_ids, -1, dims=1))


def scores_factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """The same model with attention written out by hand and the slopes computed inline (MPT)."""
    return factory(seq_len, seed, form="scores", slopes="inline")


MEMBERS = [
    Member("alibi", "BLOOM-style ALiBi: slopes buffer · (k − q) from aranges, causal, as SDPA's attn_mask "
           "-> a score rule of global positions", factory, worlds=(4,)),
    Member("alibi_scores", "MPT-style ALiBi: slopes computed inline, bias added to hand-written scores "
           "-> a score rule", scores_factory),
]
