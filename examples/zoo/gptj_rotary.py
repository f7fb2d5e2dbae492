"""GPT-J (Hugging Face ``modeling_gptj.py`` / mesh-transformer-jax): interleaved, partial rotary
and the parallel residual.

Rotary on pairs of adjacent features (``rotate_every_two``: ``x1 = x[..., ::2]``,
``x2 = x[..., 1::2]``, ``torch.stack((-x2, x1), dim=-1).flatten(-2)``), its sin/cos tables
built in ``forward`` from ``torch.arange(S)`` and widened with ``repeat_interleave(2)``,
applied to the first 25% of each head's features only (``rotary_dim``), the rest passed
through and concatenated back. Each block is ``x + attn(ln(x)) + mlp(ln(x))``, attention
and MLP reading the same normalised input (one LayerNorm).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

DIM, HEADS, HEAD_DIM, ROTARY_DIM, VOCAB = 64, 4, 16, 4, 101  # rotary on 4 of 16 features a head


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)  # (x0, x1, ...) -> (-x1, x0, -x3, x2, ...)


def apply_rotary_pos_emb(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    sin = torch.repeat_interleave(sin[:, None, :], 2, dim=-1)  # (S, 1, rot): each angle for a pair
    cos = torch.repeat_interleave(cos[:, None, :], 2, dim=-1)
    return (x * cos) + (rotate_every_two(x) * sin)


class GPTJAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.v_proj, self.out_proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, HEADS, HEAD_DIM)  # (B, S, H, hd)
        k = self.k_proj(x).view(B, S, HEADS, HEAD_DIM)
        v = self.v_proj(x).view(B, S, HEADS, HEAD_DIM)
        k_rot, k_pass = k[:, :, :, :ROTARY_DIM], k[:, :, :, ROTARY_DIM:]
        q_rot, q_pass = q[:, :, :, :ROTARY_DIM], q[:, :, :, ROTARY_DIM:]
        k = torch.cat([apply_rotary_pos_emb(k_rot, sin, cos), k_pass], dim=-1)
        q = torch.cat([apply_rotary_pos_emb(q_rot, sin, cos), q_pass], dim=-1)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # (B, H, S, hd)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(o.permute(0, 2, 1, 3).contiguous().view(B, S, DIM))


class GPTJBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = GPTJAttention()
        self.fc_in, self.fc_out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(h, sin, cos) + self.fc_out(F.gelu(self.fc_in(h), approximate="tanh"))  # parallel


class GPTJForCausalLM(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList([GPTJBlock() for _ in range(n_layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.int64) / ROTARY_DIM))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (rot/2,)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)  # (B, S, d)
        t = torch.arange(input_ids.shape[1], dtype=torch.float32)  # (S,)
        sinusoid = torch.einsum("i,j->ij", t, self.inv_freq)  # (S, rot/2)
        sin, cos = torch.sin(sinusoid), torch.cos(sinusoid)
        for block in self.h:
            x = block(x, sin, cos)
        logits = self.lm_head(self.ln_f(x))  # (B, S, V)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """(GPTJForCausalLM, (input_ids, labels)) with labels pre-shifted (labels[:, t] follows token t)."""
    torch.manual_seed(seed)
    model = GPTJForCausalLM()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, seq_len + 1), generator=g)
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


MEMBER = Member("gptj_rotary", "GPT-J: interleaved rotary (stack((-x2, x1)).flatten) on the first 25% of the head "
                "dim, tables from arange(S) with repeat_interleave(2), parallel attention + MLP residual", factory)
