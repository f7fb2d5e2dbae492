"""Packed documents: models whose attention stays inside each document of a packed row.

* :class:`PackedLlama`: Hugging Face Llama (tiny, examples/hf_models.py) called with
  ``position_ids`` restarting at each document and no KV cache, so Hugging Face builds its
  packed-sequence mask (``cumsum(diff(position_ids) != 1)`` ids);
* :class:`DocAttention`: two hand-written attention layers under ``same document & causal``,
  the documents given as ids, as ``cu_seqlens`` or by separator tokens.

The ``ring_cp`` backend hands the ring op the document ids (``doc_ids``, 4-8 bytes a token)
instead of an S x S mask::

    cp-compile explain examples/packed.py:packed_llama_factory
    cp-compile explain examples/packed.py:doc_attention_factory
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

import hf_models

S = 96  # hidden 64, vocab and MLP 128: no activation dim equals S
# Row 0: 3 documents (5 tokens: shorter than one zig-zag chunk at N = 4; 58: longer than a rank's
# 24 or 48 tokens); row 1: 2 documents.
LENGTHS = [[5, 58, 33], [41, 55]]


def positions(lengths: List[List[int]]) -> torch.Tensor:
    """(B, S) position_ids restarting at 0 at each document of each row."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def doc_ids(lengths: List[List[int]]) -> torch.Tensor:
    """(B, S) int64 document ids 0, 1, ... of each row."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


class PackedLlama(torch.nn.Module):
    """``loss = llama(input_ids, labels=, position_ids=, attention_mask=)`` (no KV cache: HF checks packing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = hf_models.hf_model("llama", use_cache=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels, position_ids=position_ids,
                       attention_mask=attention_mask).loss


class DocAttention(torch.nn.Module):
    """Two attention layers over x (B, S, 16) under ``same document & causal (& key padding)``.

    ``form`` says where the documents come from and how the term is written: ``"index"``
    (``doc`` (B, S) ids, ``doc[:, :, None] == doc[:, None, :]``), ``"unsqueeze"`` (the same with
    ``unsqueeze``), ``"head_dim_last"`` (the conjunction at (B, S, S), then ``[:, None]``),
    ``"cu_seqlens"`` (``doc`` holds flash-attn's cu_seqlens; ids by ``searchsorted``), ``"eos"``
    (``doc`` holds token ids, also embedded; a document starts after each 0), ``"activations"``
    (ids from hidden states: the ring cannot have them whole, refused)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(16, 48) for _ in range(2))
        self.head = torch.nn.Linear(16, 1)
        self.emb = torch.nn.Embedding(8, 16)

    def mask(self, x: torch.Tensor, doc: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
        pos = torch.arange(x.shape[1])
        causal = pos[None, :] <= pos[:, None]  # (S, S): kv <= q
        if self.form == "cu_seqlens":  # doc holds cu_seqlens [0, l0, l0 + l1, ..., S]
            ids = torch.searchsorted(doc, pos, right=True) - 1  # (S,)
            same = ids[:, None] == ids[None, :]  # (S, S)
        elif self.form == "eos":  # doc holds token ids (also embedded: sharded); a document starts after each 0
            ids = (doc == 0).cumsum(-1) - (doc == 0).long()  # (B, S)
            same = (ids[:, :, None] == ids[:, None, :])[:, None]
        elif self.form == "activations":  # ids from hidden states (x here is tanh(x)): not computable whole
            ids = (x[..., 0] > 0).long().cumsum(-1)
            same = (ids[:, :, None] == ids[:, None, :])[:, None]
        elif self.form == "unsqueeze":
            same = (doc.unsqueeze(-1) == doc.unsqueeze(-2)).unsqueeze(1)  # (B, 1, S, S)
        elif self.form == "head_dim_last":  # the whole conjunction built at (B, S, S), the head dim added at the end
            mask = (doc[:, :, None] == doc[:, None, :]) & causal
            return (mask if keep is None else mask & keep[:, None, :].bool())[:, None]  # (B, 1, S, S)
        else:
            same = (doc[:, :, None] == doc[:, None, :])[:, None]  # (B, 1, S, S)
        mask = same & causal
        return mask if keep is None else mask & keep[:, None, None, :].bool()

    def forward(self, x: torch.Tensor, doc: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.form == "eos":
            x = x + self.emb(doc)
        elif self.form == "activations":
            x = torch.tanh(x)
        mask = self.mask(x, doc, keep)
        b, s, _ = x.shape
        for qkv in self.qkv:
            q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, 16)
        return self.head(x).pow(2).mean()


def packed_llama_factory(seq_len: int = S) -> Tuple[PackedLlama, Tuple[torch.Tensor, ...]]:
    """``(PackedLlama(), (input_ids, labels, position_ids))``: LENGTHS, the last documents cut to ``seq_len``."""
    ids, labels = hf_models.hf_tokens(seq_len)
    lengths = [row[:-1] + [row[-1] - (S - seq_len)] for row in LENGTHS]
    return PackedLlama(), (ids, labels, positions(lengths))


def doc_attention_factory(seq_len: int = S, form: str = "index") -> Tuple[DocAttention, Tuple[torch.Tensor, ...]]:
    """``(DocAttention(form), (x, doc))`` with LENGTHS' documents (``cu_seqlens`` for that form)."""
    x = torch.randn(2, seq_len, 16, generator=torch.Generator().manual_seed(1))
    lengths = [row[:-1] + [row[-1] - (S - seq_len)] for row in LENGTHS]
    doc = torch.tensor([0, 5, 63, seq_len]) if form == "cu_seqlens" else doc_ids(lengths)
    return DocAttention(form), (x, doc)
