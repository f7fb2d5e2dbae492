"""A Llama decoder with a sequence-classification head, as Hugging Face writes
``LlamaForSequenceClassification`` (``GenericForSequenceClassification`` in
``transformers/modeling_layers.py``; GPT-2's is the same).

The score head runs over every token; the pooled logits are those of each row's last real
token, found by data: rows are right-padded with ``pad_token_id`` to different lengths,
``non_pad_mask = (input_ids != pad).to(torch.int32)``, ``last = (arange(S) * non_pad_mask).argmax(-1)``
and ``pooled = logits[arange(B), last]``, then cross-entropy against one label per row.
Under ring_cp the argmax is each rank's own, finished over N candidates (rules/order.py), and
the pooled row is read from the rank that holds it (rules/getitem.py): nothing is gathered.
Right padding under causal attention leaves the real tokens unaffected, so no padding mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

DIM, HEADS, HEAD_DIM, HIDDEN, VOCAB, LABELS, PAD = 32, 4, 8, 88, 101, 3, 0


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(dim)), eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(DIM), LlamaRMSNorm(DIM)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = hidden_states.shape
        x = self.input_layernorm(hidden_states)
        q, k, v = (p(x).view(B, S, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden_states = hidden_states + self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        x = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaForSequenceClassification(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(n_layers))
        self.norm, self.rotary_emb = LlamaRMSNorm(DIM), LlamaRotaryEmbedding()
        self.score = nn.Linear(DIM, LABELS, bias=False)
        self.num_labels, self.pad_token_id = LABELS, PAD

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        logits = self.score(self.norm(hidden_states))  # (B, S, num_labels): every token scored
        batch_size = input_ids.shape[0]
        # the rightmost token that is not pad_token_id (Hugging Face's GenericForSequenceClassification)
        non_pad_mask = (input_ids != self.pad_token_id).to(logits.device, torch.int32)
        token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]
        return F.cross_entropy(pooled_logits.view(-1, self.num_labels), labels.view(-1))


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """(model, (input_ids, labels)): rows of real lengths S, ~0.7 S and ~0.3 S, right-padded with PAD."""
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification()
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(1, VOCAB, (BATCH, seq_len), generator=g)
    for row, length in enumerate((seq_len, seq_len * 7 // 10, seq_len * 3 // 10)[:BATCH]):
        input_ids[row, length:] = PAD
    labels = torch.randint(0, LABELS, (BATCH,), generator=g)
    return model, (input_ids, labels)


MEMBER = Member("seq_classification", "Hugging Face LlamaForSequenceClassification: score head over every token, "
                "right padding, pooled at (arange(S) * (ids != pad)).argmax(-1) by logits[arange(B), last] "
                "(argmax and the read finished over the ranks, no gather)", factory)
