"""``nn.TransformerEncoder`` in its default layout: sequence first, (S, B, E), with padding.

The PyTorch tutorial's text classifier written sequence-first (``batch_first=False``, the
default): token embedding scaled by √d plus a sinusoidal position buffer indexed
``pe[:S]`` (shape (S, 1, E)), ``nn.TransformerEncoder`` of post-norm layers with a
``src_key_padding_mask`` (B, S) bool (True at padding), a per-token tagging head and a
cross-entropy over the non-padded tokens (padding labels −100). The sequence lives at dim
0 of every activation; the padding mask is a (B, S) key mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int = 256) -> None:
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)  # (max_len, 1, E)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (S, B, E)
        return x + self.pe[: x.size(0)]


class TransformerTagger(nn.Module):
    def __init__(self, ntoken: int = 101, d_model: int = 32, nhead: int = 4, d_hid: int = 64,
                 nlayers: int = 2, ntags: int = 7) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout=0.0)  # batch_first=False
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntags)

    def forward(self, src: torch.Tensor, src_key_padding_mask: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        """src (S, B) token ids, src_key_padding_mask (B, S) True at padding, tags (S, B)."""
        x = self.embedding(src) * math.sqrt(self.d_model)  # (S, B, E)
        x = self.pos_encoder(x)
        x = self.transformer_encoder(x, src_key_padding_mask=src_key_padding_mask)  # (S, B, E)
        logits = self.linear(x)  # (S, B, T)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tags.view(-1), ignore_index=-100)


def factory(seq_len: int = SEQ_LEN, seed: int = 0, train: bool = True):
    """Sequence-first batch of 3 with 0, 13 and 31 padded positions at the end."""
    torch.manual_seed(seed)
    model = TransformerTagger().train(train)
    src = torch.randint(1, 101, (seq_len, BATCH))  # (S, B)
    lengths = torch.tensor([seq_len, seq_len - 13, seq_len - 31])
    pad = torch.arange(seq_len)[None, :] >= lengths[:, None]  # (B, S) True at padding
    tags = torch.randint(0, 7, (seq_len, BATCH)).masked_fill(pad.t(), -100)  # (S, B)
    return model, {"src": src, "src_key_padding_mask": pad, "tags": tags}


MEMBER = Member("nn_encoder", "nn.TransformerEncoder batch_first=False (S, B, E), src_key_padding_mask, per-token loss",
                factory)
