"""A Gemma-2-style decoder (Hugging Face ``modeling_gemma2.py``), plain PyTorch.

Embeddings scaled by √d (the normaliser cast to the embedding dtype), RMSNorm with
``(1 + weight)`` computed in float32, pre- and post-norms around attention and the MLP,
GeGLU (``gelu`` tanh approximation), RoPE from ``arange`` positions, grouped-query
attention with ``query_pre_attn_scalar``, layers alternating a sliding window of 16
(a mask built from positions, as Gemma 2 writes it) and global causal attention,
final-logit soft-capping ``tanh(logits / c) · c``, and the Hugging Face loss, which
shifts the labels (``pad(labels, (0, 1), -100)[..., 1:]``). Attention-logit soft-capping
needs a ``score_mod`` (FlexAttention), not SDPA: left out here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB, WINDOW = 32, 4, 2, 8, 96, 101, 16


class Gemma2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)  # Gemma: (1 + w), in float32


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Gemma2Attention(nn.Module):
    def __init__(self, sliding: bool) -> None:
        super().__init__()
        self.sliding, self.scaling = sliding, 24 ** -0.5  # query_pre_attn_scalar = 24
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, HEAD_DIM).transpose(1, 2)  # (B, H, S, hd)
        k = self.k_proj(x).view(B, S, -1, HEAD_DIM).transpose(1, 2)  # (B, H_kv, S, hd)
        v = self.v_proj(x).view(B, S, -1, HEAD_DIM).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.sliding:  # causal within a window: query i sees keys i - 15 .. i
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < WINDOW)  # (S, S)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, sliding: bool) -> None:
        super().__init__()
        self.self_attn = Gemma2Attention(sliding)
        self.gate_proj, self.up_proj = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.input_layernorm, self.post_attention_layernorm = Gemma2RMSNorm(DIM), Gemma2RMSNorm(DIM)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = Gemma2RMSNorm(DIM), Gemma2RMSNorm(DIM)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, pos))
        h = self.pre_feedforward_layernorm(x)
        h = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))  # GeGLU
        return x + self.post_feedforward_layernorm(h)


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, n_layers: int = 2, final_logit_softcapping: float = 30.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Gemma2DecoderLayer(sliding=i % 2 == 0) for i in range(n_layers)])
        self.norm, self.softcap = Gemma2RMSNorm(DIM), final_logit_softcapping
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, S, d)
        x = x * torch.tensor(DIM ** 0.5, dtype=x.dtype)  # the normaliser in the embedding dtype
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)  # (S,)
        freqs = pos[:, None].float() * self.inv_freq[None, :]  # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            x = layer(x, cos, sin, pos)
        logits = self.lm_head(self.norm(x))  # (B, S, V)
        logits = torch.tanh(logits / self.softcap) * self.softcap  # final-logit soft-capping
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # HF ForCausalLMLoss
        return F.cross_entropy(logits.float().view(-1, VOCAB), shift_labels.view(-1), ignore_index=-100)


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """(Gemma2ForCausalLM, (input_ids, labels)): labels unshifted, a few -100."""
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, seq_len), generator=g)
    labels = ids.clone()
    labels[torch.rand(BATCH, seq_len, generator=g) < 0.1] = -100
    return model, (ids, labels)


MEMBER = Member("gemma2", "Gemma 2: √d-scaled embeddings, (1 + w) RMSNorm pre/post norms, GeGLU, sliding-window (16) "
                "and global layers alternating, final-logit soft-capping, HF label shift", factory, worlds=(2, 4))
