"""A prefix-LM with a soft prompt: learned prompt embeddings before the tokens, bidirectional over them.

P learned prompt vectors (an ``nn.Parameter``, as in prompt tuning / prefix-LM code) are
concatenated before the T token embeddings along the sequence, so attention runs over
S = P + T positions. The mask is built in ``forward`` from positions: every query sees the
whole prefix and, after it, the keys up to itself (``(kv <= q) | (kv < P)``). The loss is
the next-token loss on the T token positions only (labels padded with -100 over the prompt,
as PEFT's prompt tuning does). Under ``ring_cp`` the concatenation is
sharded where the sequence arises (row selection) and the mask becomes a mask rule of
global positions in the ring op (no S x S or c x S tensor).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

PROMPT = 16  # learned prefix positions P; the tokens are S - P


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, S, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class PrefixLM(nn.Module):
    def __init__(self, vocab: int, dim: int, n_heads: int, n_layers: int, n_prompt: int, max_len: int) -> None:
        super().__init__()
        self.n_prompt = n_prompt
        self.prompt = nn.Parameter(torch.randn(n_prompt, dim) * 0.02)  # the soft prompt
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Layer(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def prefix_mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(S, S) bool, True = attend: bidirectional over the prompt, causal after it."""
        q = torch.arange(seq_len, device=device)[:, None]
        kv = torch.arange(seq_len, device=device)[None, :]
        return (kv <= q) | (kv < self.n_prompt)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b = input_ids.shape[0]
        x = torch.cat([self.prompt.expand(b, -1, -1), self.tok(input_ids)], dim=1)  # (B, P + T, dim)
        s = x.shape[1]
        x = x + self.pos(torch.arange(s, device=x.device))
        mask = self.prefix_mask(s, x.device)
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.head(self.norm(x))  # (B, P + T, vocab)
        ignore = torch.full((b, self.n_prompt), -100, dtype=labels.dtype, device=labels.device)
        labels = torch.cat([ignore, labels], dim=1)  # as PEFT's prompt tuning: no loss on the prompt
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def factory(seq_len: int = SEQ_LEN, seed: int = 0, *, batch: int = BATCH, n_prompt: int = PROMPT):
    """(model, (input_ids, labels)) with ``seq_len - n_prompt`` tokens, so attention runs over ``seq_len``."""
    torch.manual_seed(seed)
    model = PrefixLM(vocab=101, dim=32, n_heads=4, n_layers=2, n_prompt=n_prompt, max_len=128)
    tokens = seq_len - n_prompt
    input_ids = torch.randint(0, 101, (batch, tokens))
    return model, (input_ids, torch.roll(input_ids, -1, dims=1))


MEMBER = Member("prefix_lm", "prefix-LM with a learned soft prompt (nn.Parameter) concatenated before the tokens; "
                "mask (kv <= q) | (kv < P) from aranges -> a mask rule of global positions", factory, worlds=(2, 4))
