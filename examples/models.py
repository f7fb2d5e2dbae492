"""Small example transformers used as test and demo inputs for cp_compile.

These are written the way users write models: plain PyTorch, no cp_compile
imports, nothing arranged for the compiler. The ``ring_cp`` backend has to make
them context-parallel unchanged (docs/design.md §6), so they deliberately contain the
patterns that pass has to handle:

- ``Llama``: RoPE tables as ``max_seq_len`` buffers cut to the input length in
  ``forward`` (``[:S]`` or indexed by ``torch.arange(S)``), grouped-query attention
  (``enable_gqa=True`` or ``repeat_interleave``), cross-entropy with ``ignore_index``
  and optionally the Hugging Face label shift inside the model.
- ``GPT2``: learned absolute positions ``wpe(torch.arange(S))`` and a tied head.
- ``Encoder``: bidirectional (non-causal) attention with a per-token regression
  head and a mean-squared-error loss.

Each ``*_factory`` returns ``(model, example_inputs)`` built deterministically from
``seed``, so the same call gives the same weights and data in every process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# ---------- Llama
@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    gqa_mode: str = "enable_gqa"  # "enable_gqa" | "repeat_interleave" | "expand" (Hugging Face repeat_kv)
    rope_style: str = "arange_index"  # "arange_index" | "slice"
    norm_eps: float = 1e-5
    ignore_index: int = -100
    # False: labels come shifted by the caller (labels[:, t] = target of position t).
    # True: labels are the unshifted ids; forward shifts them, Hugging Face style.
    shift_labels_inside: bool = False
    # True: a graph break after every layer (eager code between compiled pieces).
    graph_break_between_layers: bool = False
    # True: a graph break between the embedding and the first layer / between the last
    # layer and the final norm (outside the loop, so Dynamo compiles every piece).
    graph_break_after_embedding: bool = False
    graph_break_before_head: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, S, H, D); cos, sin: (S, D) -> broadcast as (1, S, 1, D)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape  # (B, S, dim)
        q = self.wq(x).view(B, S, self.cfg.n_heads, self.head_dim)  # (B, S, H, D)
        k = self.wk(x).view(B, S, self.cfg.n_kv_heads, self.head_dim)  # (B, S, Hkv, D)
        v = self.wv(x).view(B, S, self.cfg.n_kv_heads, self.head_dim)  # (B, S, Hkv, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H*, S, D)
        if self.cfg.gqa_mode == "enable_gqa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.cfg.gqa_mode == "repeat_interleave":
            n_rep = self.cfg.n_heads // self.cfg.n_kv_heads
            k = k.repeat_interleave(n_rep, dim=1)  # (B, H, S, D)
            v = v.repeat_interleave(n_rep, dim=1)  # (B, H, S, D)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.cfg.gqa_mode == "expand":
            n_rep, hkv = self.cfg.n_heads // self.cfg.n_kv_heads, self.cfg.n_kv_heads
            k = k[:, :, None].expand(B, hkv, n_rep, S, self.head_dim).reshape(B, hkv * n_rep, S, self.head_dim)
            v = v[:, :, None].expand(B, hkv, n_rep, S, self.head_dim).reshape(B, hkv * n_rep, S, self.head_dim)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            raise ValueError(f"unknown gqa_mode {self.cfg.gqa_mode!r}")
        o = o.transpose(1, 2).reshape(B, S, -1)  # (B, S, H*D)
        return self.wo(o)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.rope_style not in ("slice", "arange_index"):
            raise ValueError(f"unknown rope_style {cfg.rope_style!r}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        t = torch.arange(cfg.max_seq_len).float()
        freqs = torch.outer(t, inv_freq)  # (L, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, D)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)  # (L, D)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)  # (L, D)

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """input_ids: (B, S) int64. labels: (B, S) int64 or None.

        Returns logits (B, S, V) without labels, else the mean cross-entropy over
        labels != ignore_index. Unless ``cfg.shift_labels_inside``, labels must be
        already shifted by the caller: labels[:, t] is the target of position t.
        """
        B, S = input_ids.shape
        if self.cfg.rope_style == "slice":
            cos, sin = self.rope_cos[:S], self.rope_sin[:S]  # (S, D)
        else:
            pos = torch.arange(S, device=input_ids.device)  # (S,)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (S, D)
        x = self.tok_emb(input_ids)  # (B, S, dim)
        if self.cfg.graph_break_after_embedding:
            torch._dynamo.graph_break()
        for layer in self.layers:
            x = layer(x, cos, sin)
            if self.cfg.graph_break_between_layers:
                torch._dynamo.graph_break()
        if self.cfg.graph_break_before_head:
            torch._dynamo.graph_break()
        logits = self.lm_head(self.norm(x))  # (B, S, V)
        if labels is None:
            return logits
        V = logits.size(-1)  # vocab size
        if self.cfg.shift_labels_inside:
            logits = logits[:, :-1, :].contiguous()  # (B, S-1, V)
            labels = labels[:, 1:].contiguous()  # (B, S-1)
        ignore = self.cfg.ignore_index
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=ignore)


# ---------- GPT-2
@dataclass
class GPT2Config:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    ignore_index: int = -100


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (GPT-2 / BERT style)."""

    def __init__(self, dim: int, n_heads: int, causal: bool) -> None:
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, S, C = x.shape  # (B, S, dim)
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, S, dim)
        q = q.view(B, S, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, S, D)
        k = k.view(B, S, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, S, D)
        v = v.view(B, S, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, H, S, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, S, D)
        return self.proj(o.transpose(1, 2).contiguous().view(B, S, C))


class PreLNBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x)) with GELU."""

    def __init__(self, dim: int, n_heads: int, hidden: int, causal: bool, eps: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, n_heads, causal)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU("tanh"), nn.Linear(hidden, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.h = nn.ModuleList(
            PreLNBlock(cfg.dim, cfg.n_heads, 4 * cfg.dim, True, cfg.norm_eps)
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """Same contract as ``Llama.forward`` with labels already shifted by the caller."""
        B, S = input_ids.shape
        pos = torch.arange(S, device=input_ids.device)  # (S,)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, S, dim)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, S, V)
        if labels is None:
            return logits
        V = logits.size(-1)
        ignore = self.cfg.ignore_index
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=ignore)


# ---------- Encoder
@dataclass
class EncoderConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 128
    out_dim: int = 8
    max_seq_len: int = 4096
    pos_style: str = "sinusoidal"  # "sinusoidal" | "learned"
    norm_eps: float = 1e-5


class Encoder(nn.Module):
    """Bidirectional encoder over precomputed embeddings, per-token regression head."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        if cfg.pos_style not in ("sinusoidal", "learned"):
            raise ValueError(f"unknown pos_style {cfg.pos_style!r}")
        self.cfg = cfg
        learned = cfg.pos_style == "learned"
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim) if learned else None
        self.layers = nn.ModuleList(
            PreLNBlock(cfg.dim, cfg.n_heads, cfg.ffn_hidden, False, cfg.norm_eps)
            for _ in range(cfg.n_layers)
        )
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.out_dim)

    def positions(self, S: int, device: torch.device) -> Tensor:
        pos = torch.arange(S, device=device)  # (S,)
        if self.pos_emb is not None:
            return self.pos_emb(pos)  # (S, dim)
        half = self.cfg.dim // 2
        freq = torch.exp(torch.arange(half, device=device) * (-math.log(10000.0) / half))
        angles = pos.float()[:, None] * freq[None, :]  # (S, dim/2)
        return torch.cat((angles.sin(), angles.cos()), dim=-1)  # (S, dim)

    def forward(self, x: Tensor, targets: Optional[Tensor] = None) -> Tensor:
        """x: (B, S, dim) float. Returns (B, S, out_dim), or the MSE against targets."""
        B, S, _ = x.shape
        x = x + self.positions(S, x.device)  # (B, S, dim)
        for layer in self.layers:
            x = layer(x)
        out = self.head(self.norm(x))  # (B, S, out_dim)
        if targets is None:
            return out
        return F.mse_loss(out, targets)


# ---------- Factories
def shift_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """(B, S) token ids -> (B, S) targets: shifted left by one, last = ignore_index."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat((labels[:, 1:], pad), dim=1)


def _token_data(
    vocab: int, batch: int, seq_len: int, seed: int, ignore_index: int, shift: bool
) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=g)  # (B, S)
    labels = input_ids.clone()
    ignore = torch.rand(batch, seq_len, generator=g) < 0.1  # a few masked targets
    labels[ignore] = ignore_index
    return input_ids, shift_labels(labels, ignore_index) if shift else labels


def llama_factory(
    seq_len: int = 64, batch: int = 2, seed: int = 0, **cfg_overrides
) -> Tuple[Llama, Tuple[Tensor, Tensor]]:
    """Returns (model, (input_ids, labels)). Labels are pre-shifted unless the model
    has ``shift_labels_inside=True``, then unshifted; both describe the same targets."""
    cfg = LlamaConfig(**cfg_overrides)
    torch.manual_seed(seed)
    model = Llama(cfg)
    shift = not cfg.shift_labels_inside
    return model, _token_data(cfg.vocab_size, batch, seq_len, seed, cfg.ignore_index, shift)


def gpt2_factory(
    seq_len: int = 64, batch: int = 2, seed: int = 0, **cfg_overrides
) -> Tuple[GPT2, Tuple[Tensor, Tensor]]:
    """Returns (model, (input_ids, labels)) with labels pre-shifted."""
    cfg = GPT2Config(**cfg_overrides)
    torch.manual_seed(seed)
    model = GPT2(cfg)
    return model, _token_data(cfg.vocab_size, batch, seq_len, seed, cfg.ignore_index, True)


def encoder_factory(
    seq_len: int = 64, batch: int = 2, seed: int = 0, **cfg_overrides
) -> Tuple[Encoder, Tuple[Tensor, Tensor]]:
    """Returns (model, (x, targets)) with x (B, S, dim) and targets (B, S, out_dim)."""
    cfg = EncoderConfig(**cfg_overrides)
    torch.manual_seed(seed)
    model = Encoder(cfg)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, cfg.dim, generator=g)
    targets = torch.randn(batch, seq_len, cfg.out_dim, generator=g)
    return model, (x, targets)
