"""GPT-style language model built from ``nn.TransformerEncoderLayer`` with a causal mask.

The common way to write a decoder-only model with stock ``torch.nn`` layers: pre-norm
``nn.TransformerEncoderLayer(batch_first=True)`` blocks given
``nn.Transformer.generate_square_subsequent_mask(S)`` as ``mask`` together with
``is_causal=True``, learned positions from ``arange(S)``, a tied LM head, next-token
loss on labels shifted before the model.

``nn.TransformerDecoderLayer`` used "decoder-only" (``layer(x, memory=x)``) is not this
model: its second attention is cross-attention from x to the memory, which ring_cp
refuses by name (see tests/test_zoo_encoders.py); the fix is this file's form.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class EncoderLayerGPT(nn.Module):
    def __init__(self, vocab: int = 101, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(S, device=tokens.device))  # (B, S, D)
        mask = nn.Transformer.generate_square_subsequent_mask(S, device=tokens.device)  # (S, S) -inf above
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.ln_f(x))  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class DecoderLayerLM(nn.Module):
    """The refused form: nn.TransformerDecoderLayer with memory = the sequence itself."""

    def __init__(self, vocab: int = 101, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerDecoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)  # (B, S, D)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        x = self.layer(x, x, tgt_mask=mask, tgt_is_causal=True)  # memory = x: cross-attention
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _data(seq_len: int):
    stream = torch.randint(0, 101, (BATCH, seq_len + 1))
    return stream[:, :-1], stream[:, 1:]


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    torch.manual_seed(seed)
    model = EncoderLayerGPT()
    return model, _data(seq_len)


def decoder_layer_factory(seq_len: int = SEQ_LEN, seed: int = 0):
    torch.manual_seed(seed)
    model = DecoderLayerLM()
    return model, _data(seq_len)


MEMBER = Member("nn_decoder_only", "GPT from nn.TransformerEncoderLayer: generate_square_subsequent_mask + is_causal",
                factory)
