"""A Llama-style decoder that takes explicit ``position_ids`` (B, S) as a forward input
(Hugging Face ``LlamaModel(input_ids, position_ids=...)`` with a v4-style rotary cache).

RoPE's cos/sin are precomputed for ``max_position_embeddings`` positions in buffers and
indexed with the ids, ``cos_cached[position_ids]`` (B, S, hd). The ids are per-token
values: each row here continues a longer text from its own offset, so they are not
``arange(S)``; under ring_cp they are sharded like the tokens. RMSNorm, SwiGLU, causal
grouped-query attention (K/V heads repeated by ``repeat_interleave``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB, MAX_POS = 32, 4, 2, 8, 96, 101, 256


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv_proj = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, HEADS, HEAD_DIM).transpose(1, 2)  # (B, H, S, hd)
        k, v = self.kv_proj(x).view(B, S, 2 * KV_HEADS, HEAD_DIM).transpose(1, 2).chunk(2, dim=1)  # (B, H_kv, S, hd)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, S, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = LlamaAttention()
        self.gate_proj, self.up_proj = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(DIM, eps=1e-6), nn.RMSNorm(DIM, eps=1e-6)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([LlamaDecoderLayer() for _ in range(n_layers)])
        self.norm, self.lm_head = nn.RMSNorm(DIM, eps=1e-6), nn.Linear(DIM, VOCAB, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)  # (MAX_POS, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (MAX_POS, hd)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, S, d)
        cos, sin = self.cos_cached[position_ids], self.sin_cached[position_ids]  # (B, S, hd) each
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (B, S, V)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """(LlamaForCausalLM, kwargs input_ids / position_ids / labels): row b's positions start at its own offset."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, seq_len + 1), generator=g)
    offsets = torch.tensor([0, 7, 33])[:BATCH, None]  # (B, 1) each row continues a text at its own position
    position_ids = offsets + torch.arange(seq_len)[None, :]  # (B, S)
    return model, {"input_ids": ids[:, :-1].contiguous(), "position_ids": position_ids,
                   "labels": ids[:, 1:].contiguous()}


MEMBER = Member("position_ids", "Llama with explicit position_ids (B, S) as an input, RoPE cos/sin cache indexed "
                "cos_cached[position_ids] (ids sharded like the tokens)", factory)
