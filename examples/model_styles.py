"""Tiny transformers written in styles the main examples (``models.py``) do not use.

Each ``*_factory`` returns ``(model, (input_ids, labels))`` built deterministically from
``seed``; the model returns the mean cross-entropy over the pre-shifted labels
(``labels[:, t]`` is the target of position t), so the caller never slices inside the
graph. Sizes are tiny: the point is the shape of the code, not the model.

Styles:

* ``llama3_complex_rope_factory``: torchtitan-style Llama 3. RoPE as complex numbers
  (a ``torch.polar`` table for ``2 * max_seq_len`` positions in a buffer, sliced
  ``[0:seqlen]``, applied with ``view_as_complex`` / ``view_as_real``), ``nn.RMSNorm``,
  optional grouped-query attention with the KV heads repeated by expand + reshape.
* ``einsum_gpt_factory``: a GPT whose projections are all ``torch.einsum`` (fused qkv,
  per-head weights, the attention output projection, the MLP, the LM head), a squared
  ReLU MLP (``torch.square``) and a learned position embedding.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def _token_data(vocab: int, batch: int, seq_len: int, seed: int) -> Tuple[Tensor, Tensor]:
    """(input_ids, labels), both (B, S) int64, labels pre-shifted by one position."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ---------------------------------------------------------------- Llama 3, complex RoPE
def _freqs_cis(head_dim: int, end: int, theta: float = 500000.0) -> Tensor:
    """(end, head_dim/2) complex64: e^(i * t * theta^(-2j/head_dim)) for positions t < end."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(end).float(), inv)  # (end, D/2)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """x (B, S, H, D) real rotated by freqs_cis (S, D/2) complex, as pairs of features."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, S, H, D/2) complex
    fc = freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])  # (1, S, 1, D/2) complex
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)  # (B, S, H, D)


class _Llama3Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """(B, S, H_kv, D) -> (B, S, H, D), each KV head shared by H / H_kv query heads."""
        B, S, Hkv, D = x.shape
        rep = self.heads // Hkv
        return x if rep == 1 else x[:, :, :, None, :].expand(B, S, Hkv, rep, D).reshape(B, S, Hkv * rep, D)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        B, S, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, S, self.heads, self.hd)  # (B, S, H, D)
        k, v = self.wkv(h).view(B, S, 2 * self.kv_heads, self.hd).chunk(2, dim=2)  # (B, S, H_kv, D)
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))  # (B, S, dim)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama3ComplexRope(nn.Module):
    """torchtitan-style Llama 3: complex RoPE table for 2 * max_seq_len, nn.RMSNorm, optional GQA."""

    def __init__(self, vocab: int = 96, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 max_seq_len: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Llama3Block(dim, heads, kv_heads, 3 * dim) for _ in range(layers))
        self.norm, self.out = nn.RMSNorm(dim, eps=1e-5), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(dim // heads, 2 * max_seq_len), persistent=True)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """tokens, labels: (B, S) int64 -> mean cross-entropy (scalar)."""
        seqlen = tokens.shape[1]
        freqs_cis = self.freqs_cis[0:seqlen]  # (S, D/2) complex
        x = self.tok(tokens)  # (B, S, dim)
        for layer in self.layers:
            x = layer(x, freqs_cis)
        logits = self.out(self.norm(x))  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def llama3_complex_rope_factory(seq_len: int = 16, batch: int = 2, seed: int = 0,
                                **kw) -> Tuple[Llama3ComplexRope, Tuple[Tensor, Tensor]]:
    """Returns (model, (input_ids, labels)); ``kv_heads=heads`` turns GQA off."""
    torch.manual_seed(seed)
    model = Llama3ComplexRope(**kw)
    return model, _token_data(model.tok.num_embeddings, batch, seq_len, seed)


# ---------------------------------------------------------------- GPT with einsum projections
class _EinsumBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        hd, scale = dim // heads, dim ** -0.5
        self.wqkv = nn.Parameter(torch.randn(dim, 3, heads, hd) * scale)  # fused, per head
        self.wo = nn.Parameter(torch.randn(heads, hd, dim) * scale)
        self.w_in = nn.Parameter(torch.randn(dim, 4 * dim) * scale)
        self.w_out = nn.Parameter(torch.randn(4 * dim, dim) * (4 * dim) ** -0.5)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        qkv = torch.einsum("b s d, d t h k -> t b h s k", self.ln1(x), self.wqkv)  # (3, B, H, S, hd)
        q, k, v = qkv.unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
        x = x + torch.einsum("bhsk,hkd->bsd", o, self.wo)
        h = torch.square(F.relu(torch.einsum("bsd,df->bsf", [self.ln2(x), self.w_in])))  # (B, S, 4*dim)
        return x + torch.einsum("bsf,fd->bsd", h, self.w_out)


class EinsumGPT(nn.Module):
    """A GPT written with torch.einsum projections, a squared-ReLU MLP and learned positions."""

    def __init__(self, vocab: int = 96, dim: int = 32, layers: int = 2, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_EinsumBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Parameter(torch.randn(dim, vocab) * dim ** -0.5)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """tokens, labels: (B, S) int64 -> mean cross-entropy (scalar)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)  # (S,)
        x = self.tok(tokens) + self.pos(pos)  # (B, S, dim)
        for block in self.blocks:
            x = block(x)
        logits = torch.einsum("bsd,dv->bsv", self.ln(x), self.head)  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def einsum_gpt_factory(seq_len: int = 16, batch: int = 2, seed: int = 0,
                       **kw) -> Tuple[EinsumGPT, Tuple[Tensor, Tensor]]:
    """Returns (model, (input_ids, labels))."""
    torch.manual_seed(seed)
    model = EinsumGPT(**kw)
    return model, _token_data(model.tok.num_embeddings, batch, seq_len, seed)
