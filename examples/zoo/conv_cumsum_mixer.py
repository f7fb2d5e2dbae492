"""A hybrid decoder in the style of Mamba / Hyena code: convolution-and-scan token mixers
interleaved with ordinary causal attention.

The mixer blocks run a causal depthwise ``nn.Conv1d`` over the sequence, written both ways such
code writes it: Mamba's ``self.conv1d(x.transpose(1, 2))[..., :seqlen]`` (padding K-1 on both
sides, the tail cut off) and Hyena's short filter ``conv(F.pad(x, (K-1, 0)))``, followed by a
gated running mean, ``torch.cumsum(g * v, dim=1) / arange(1, S+1)`` (a linear-attention-like
scan). Under ``ring_cp`` the convolutions read their neighbours' boundary tokens (a halo
exchange) and the cumulative sum carries the totals of the earlier chunks: no op gathers
the sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class ConvCumsumMixer(nn.Module):
    """in_proj -> causal depthwise conv -> SiLU -> gated running mean -> out_proj (gated by z)."""

    def __init__(self, dim: int, kernel: int, style: str) -> None:
        super().__init__()
        self.style, self.kernel = style, kernel
        self.in_proj = nn.Linear(dim, 2 * dim)
        padding = kernel - 1 if style == "mamba" else 0  # Hyena pads by hand, on the left only
        self.conv1d = nn.Conv1d(dim, dim, kernel, groups=dim, padding=padding)
        self.gate = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seqlen, _ = x.shape
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = u.transpose(1, 2)  # (B, D, S)
        if self.style == "mamba":
            u = self.conv1d(u)[..., :seqlen]
        else:
            u = self.conv1d(F.pad(u, (self.kernel - 1, 0)))
        u = F.silu(u.transpose(1, 2))  # (B, S, D)
        g = torch.sigmoid(self.gate(x))
        counts = torch.arange(1, seqlen + 1, device=x.device, dtype=x.dtype)[:, None]
        h = torch.cumsum(g * u, dim=1) / counts
        return self.out_proj(h * F.silu(z))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """Pre-norm residual block around a mixer (conv-and-scan or attention) and an MLP."""

    def __init__(self, dim: int, mixer: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mixer = mixer
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HybridLM(nn.Module):
    def __init__(self, vocab: int, dim: int, n_heads: int, kernel: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([
            Block(dim, ConvCumsumMixer(dim, kernel, "mamba")),
            Block(dim, Attention(dim, n_heads)),
            Block(dim, ConvCumsumMixer(dim, kernel, "hyena")),
            Block(dim, Attention(dim, n_heads)),
        ])
        self.norm_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def factory(seq_len: int = SEQ_LEN, seed: int = 0, *, batch: int = BATCH, vocab: int = 101, dim: int = 32,
            n_heads: int = 4, kernel: int = 4):
    """(model, (input_ids, labels)): two conv-and-cumsum mixers (Mamba- and Hyena-style convs), two attentions."""
    torch.manual_seed(seed)
    model = HybridLM(vocab, dim, n_heads, kernel)
    input_ids = torch.randint(0, vocab, (batch, seq_len))
    return model, (input_ids, torch.roll(input_ids, -1, dims=1))


MEMBER = Member(
    "conv_cumsum_mixer",
    "Mamba/Hyena-style hybrid: causal depthwise Conv1d (conv(x)[..., :S] and F.pad + conv) and a gated cumsum "
    "running mean, interleaved with causal SDPA -> halo exchange + chunked scan, no gather",
    factory,
)
