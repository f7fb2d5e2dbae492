"""nanoGPT (karpathy/nanoGPT ``model.py``) with the label shift inside the model.

Learned ``wpe`` read at ``torch.arange(0, t)``, a fused ``c_attn`` split into q/k/v, causal
SDPA, the token embedding tied to ``lm_head``, and the loss computed in ``forward`` on the
shifted sequence: the model gets ``idx`` and ``targets = idx`` unshifted, and scores
``logits[:, :-1]`` against ``targets[:, 1:]``. Under ring_cp the shift moves only labels
(integers every rank holds whole), never the logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # (B, T, C)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 101, block_size: int = 128, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 32, shift: int = 1) -> None:
        super().__init__()
        self.shift = shift  # how many positions ahead the target lies (1: next-token prediction)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # shape (t)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (b, t, n_embd)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (b, t, vocab)
        n = self.shift
        logits, targets = logits[:, :-n, :], targets[:, n:]  # position i predicts token i + n
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def factory(seq_len: int = SEQ_LEN, seed: int = 0, shift: int = 1):
    """(GPT, (idx, targets)): targets is idx itself with a few positions set to ignore_index -1."""
    torch.manual_seed(seed)
    model = GPT(shift=shift)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, 101, (BATCH, seq_len), generator=g)
    targets = idx.clone()
    targets[torch.rand(BATCH, seq_len, generator=g) < 0.1] = -1  # some targets ignored
    return model, (idx, targets)


MEMBER = Member("nanogpt", "nanoGPT: wpe at arange(t), fused c_attn, tied lm_head, loss on logits[:, :-1] vs "
                "targets[:, 1:] inside forward (labels shifted, logits never gathered)", factory, worlds=(2, 4))
