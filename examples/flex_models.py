"""Tiny transformers whose attention is FlexAttention, one per kind of mask_mod / score_mod.

Each ``*_factory(seq_len, batch, seed)`` returns ``(model, inputs)`` built deterministically
from ``seed``; ``model(*inputs)`` is the mean cross-entropy over pre-shifted labels (the
caller never slices inside the graph). The styles differ in how the mods are written:

* ``causal_factory``: ``create_block_mask(causal, None, None, S, S)`` inside forward, a
  module-level mask_mod;
* ``document_buffer_factory``: packed documents, the document ids a module buffer (S,)
  that a mask_mod closure reads (document shorter than one rank's chunk, one longer);
* ``document_input_factory``: the document ids a (B, S) forward() argument, different per
  row, read as ``doc[b, q_idx]`` by a mask_mod defined inside forward;
* ``sliding_window_factory``: a causal window of ``window`` keys, the mask_mod made by a factory;
* ``prefix_lm_factory``: bidirectional over the first ``prefix`` tokens, causal after;
* ``alibi_factory``: causal mask_mod plus an ALiBi score_mod reading per-head slopes
  (a buffer (H,)): ``score + slope[h] * (kv_idx - q_idx)``;
* ``softcap_factory``: causal, with a logit soft-cap score_mod ``c * tanh(score / c)`` and
  no captured tensor;
* ``outside_mask_factory``: the BlockMask built once outside the model (document mask)
  and passed to forward() as an argument;
* ``gqa_factory``: causal, 4 query heads sharing 2 k/v heads (``enable_gqa=True``);
* ``learned_alibi_factory``: causal, ALiBi with LEARNED slopes (an ``nn.Parameter`` (H,)) read by
  the score_mod: the ring's backward returns their gradient;
* ``t5_bias_factory``: no mask (bidirectional), T5's learned relative-position bias
  ``score + table[bucket(kv_idx - q_idx), h]`` (an ``nn.Parameter`` (buckets, H), T5's bucket function).

FlexAttention on CPU refuses inputs that require grad (its compiled CPU kernel has no
backward), though its dense implementation (eager and ``aot_eager``) has one: importing
this module lifts that check for CPU (:func:`allow_cpu_backward`), so the tests can train
on CPU. On a GPU nothing changes.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.attention.flex_attention as _flex
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

DOC_LENGTHS = (5, 17, 3, 23, 16)  # tokens per packed document; cycled to fill the sequence


def allow_cpu_backward() -> None:
    """Let flex_attention take CPU inputs that require grad (the dense math path differentiates them)."""
    check = _flex._validate_device
    if getattr(check, "_cpu_backward_allowed", False):
        return

    def validate(query: Tensor, key: Tensor, value: Tensor) -> None:
        if query.device.type != "cpu":
            check(query, key, value)

    validate._cpu_backward_allowed = True  # type: ignore[attr-defined]
    _flex._validate_device = validate


allow_cpu_backward()


def packed_doc_ids(seq_len: int, lengths: Tuple[int, ...] = DOC_LENGTHS, shift: int = 0) -> Tensor:
    """(S,) int64 document id of each position: documents of ``lengths`` (cycled, from ``shift``)."""
    ids, doc, i = [], 0, shift
    while len(ids) < seq_len:
        ids += [doc] * lengths[i % len(lengths)]
        doc, i = doc + 1, i + 1
    return torch.tensor(ids[:seq_len])


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


class Block(nn.Module):
    """Pre-norm block: FlexAttention with the model's mods, then a SiLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: Tensor, block_mask: Optional[BlockMask], score_mod: Optional[Callable]) -> Tensor:
        B, S, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(B, S, self.heads, self.hd).transpose(1, 2)  # (B, H, S, D)
        k, v = self.wkv(h).view(B, S, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)  # (B, Hkv, S, D)
        o = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                           enable_gqa=self.kv_heads != self.heads)  # (B, H, S, D)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))
        return x + self.w2(F.silu(self.w1(self.n2(x))))


class FlexLM(nn.Module):
    """Embedding, ``layers`` flex blocks, LM head; the mods come from :meth:`mods` (styles override it)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def mods(self, tokens: Tensor, *extra: Tensor) -> Tuple[Optional[BlockMask], Optional[Callable]]:
        S = tokens.shape[1]
        return create_block_mask(causal, None, None, S, S, device=tokens.device), None

    def forward(self, tokens: Tensor, labels: Tensor, *extra) -> Tensor:
        block_mask, score_mod = self.mods(tokens, *extra)
        x = self.emb(tokens)  # (B, S, dim)
        for layer in self.layers:
            x = layer(x, block_mask, score_mod)
        logits = self.head(self.norm(x))  # (B, S, vocab)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class DocumentBuffer(FlexLM):
    def __init__(self, seq_len: int, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("doc", packed_doc_ids(seq_len))  # (S,)

    def mods(self, tokens, *extra):
        doc = self.doc

        def same_document(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        S = tokens.shape[1]
        return create_block_mask(same_document, None, None, S, S, device=tokens.device), None


class DocumentInput(FlexLM):
    def mods(self, tokens, doc_ids):
        doc = doc_ids.long()  # (B, S): each row packs its own documents

        def same_document(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        B, S = tokens.shape
        return create_block_mask(same_document, B, None, S, S, device=tokens.device), None


def sliding_window(window: int) -> Callable:
    """A mask_mod made by a factory: causal, at most ``window`` keys back (the query's own included)."""

    def in_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return in_window


class SlidingWindow(FlexLM):
    window = 6

    def mods(self, tokens, *extra):
        S = tokens.shape[1]
        return create_block_mask(sliding_window(self.window), None, None, S, S, device=tokens.device), None


class PrefixLM(FlexLM):
    prefix = 11

    def mods(self, tokens, *extra):
        prefix = self.prefix
        S = tokens.shape[1]
        mask = create_block_mask(lambda b, h, q, kv: (kv <= q) | (kv < prefix), None, None, S, S,
                                 device=tokens.device)
        return mask, None


class Alibi(FlexLM):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, self.heads + 1) / self.heads))  # (H,)

    def mods(self, tokens, *extra):
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        S = tokens.shape[1]
        return create_block_mask(causal, None, None, S, S, device=tokens.device), alibi


class LearnedAlibi(Alibi):
    """:class:`Alibi` with its slopes an ``nn.Parameter`` (H,): the same mods, read from a learned tensor."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        slopes = self._buffers.pop("slopes")
        self.slopes = nn.Parameter(slopes)  # (H,) learned


def t5_bucket(rel: Tensor, bidirectional: bool = True, buckets: int = 8, max_distance: int = 16) -> Tensor:
    """T5's relative-position bucket of ``rel = kv_idx - q_idx`` (HF ``_relative_position_bucket``), in torch
    operations only (runs under vmap): exact buckets for small distances, logarithmic ones up to
    ``max_distance``; bidirectional: half the buckets for keys after the query."""
    base = torch.zeros_like(rel)
    if bidirectional:
        buckets //= 2
        base = (rel > 0).long() * buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = buckets // 2
    far = exact + (torch.log(rel.clamp(min=1).float() / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).long()
    return base + torch.where(rel < exact, rel, far.clamp(max=buckets - 1))


class T5Bias(FlexLM):
    buckets = 8

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.table = nn.Parameter(0.5 * torch.randn(self.buckets, self.heads))  # (buckets, H) learned

    def mods(self, tokens, *extra):
        table, buckets = self.table, self.buckets

        def t5_bias(score, b, h, q_idx, kv_idx):
            return score + table[t5_bucket(kv_idx - q_idx, True, buckets), h]

        return None, t5_bias


def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return 2.0 * torch.tanh(score / 2.0)


class SoftCap(FlexLM):
    def mods(self, tokens, *extra):
        S = tokens.shape[1]
        return create_block_mask(causal, None, None, S, S, device=tokens.device), soft_cap


class OutsideMask(FlexLM):
    def mods(self, tokens, block_mask):
        return block_mask, None


def _data(vocab: int, batch: int, seq_len: int, seed: int) -> Tuple[Tensor, Tensor]:
    """(input_ids, labels), both (B, S) int64, labels pre-shifted by one position."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _build(cls, length: int, batch: int, seed: int, extra: tuple = (), **kw):
    """``cls(**kw)`` with seeded weights and its inputs (tokens, labels, *extra) of ``length`` tokens."""
    torch.manual_seed(seed)
    model = cls(**kw)
    return model, (*_data(64, batch, length, seed), *extra)


def causal_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(FlexLM, seq_len, batch, seed)


def document_buffer_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(DocumentBuffer, seq_len, batch, seed, seq_len=seq_len)


def document_input_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    doc_ids = torch.stack([packed_doc_ids(seq_len, shift=r) for r in range(batch)]).to(torch.int32)  # (B, S)
    return _build(DocumentInput, seq_len, batch, seed, extra=(doc_ids,))


def sliding_window_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(SlidingWindow, seq_len, batch, seed)


def prefix_lm_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(PrefixLM, seq_len, batch, seed)


def alibi_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(Alibi, seq_len, batch, seed)


def softcap_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(SoftCap, seq_len, batch, seed)


def outside_mask_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    doc = packed_doc_ids(seq_len, shift=2)

    def same_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(same_document, None, None, seq_len, seq_len, device="cpu")
    return _build(OutsideMask, seq_len, batch, seed, extra=(block_mask,))


def gqa_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(FlexLM, seq_len, batch, seed, kv_heads=2)


def learned_alibi_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(LearnedAlibi, seq_len, batch, seed)


def t5_bias_factory(seq_len: int = 32, batch: int = 2, seed: int = 0):
    return _build(T5Bias, seq_len, batch, seed)


FACTORIES = {name[:-len("_factory")]: fn for name, fn in globals().items() if name.endswith("_factory")}
