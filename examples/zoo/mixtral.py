"""A Mixtral-style mixture-of-experts decoder, written as the Mixtral reference code does.

RMSNorm, rotate-half RoPE from ``inv_freq`` and positions, causal SDPA with grouped K/V
heads, and the sparse MoE block of Hugging Face's classic ``MixtralSparseMoeBlock``: the
tokens flattened to (B·S, D), a router linear, softmax over the E = 4 experts, top-2,
renormalised; per expert the (slot, token) pairs routed to it by ``torch.where`` on a
one-hot mask, the expert's SwiGLU on those token rows, weighted, and ``index_add_`` back.
The loss adds the Switch / Mixtral load-balancing loss: E · Σ_e (fraction of tokens routed
to e) · (mean router probability of e), both means over all tokens of all layers.

Routing is per token: under ring_cp every rank routes its own tokens, and the indices
``torch.where`` finds select among this rank's rows (no gather); the two means are global.
With ``fullgraph=True`` Dynamo keeps ``torch.where(mask)`` (nonzero, a data-dependent size) in
the graph; with ``fullgraph=False`` it breaks the graph there unless
``torch._dynamo.config.capture_dynamic_output_shape_ops = True``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

VOCAB, DIM, HEADS, KV_HEADS, FFN, EXPERTS, TOP_K, AUX_COEF = 101, 32, 4, 2, 48, 4, 2, 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hd = DIM // HEADS
        self.q_proj, self.o_proj = nn.Linear(DIM, HEADS * self.hd, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, self.hd).transpose(1, 2)  # (B, H, S, hd)
        k = self.k_proj(x).view(b, s, KV_HEADS, self.hd).transpose(1, 2)  # (B, KV, S, hd)
        v = self.v_proj(x).view(b, s, KV_HEADS, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, DIM))


class Expert(nn.Module):  # Mixtral's MixtralBlockSparseTop2MLP: w2(silu(w1 x) * w3 x)
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)  # (B·S, D): the tokens
        router_logits = self.gate(hidden_states)  # (B·S, E)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, TOP_K, dim=-1)  # (B·S, k)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=EXPERTS).permute(2, 1, 0)  # (E, k, B·S)
        for expert_idx in range(EXPERTS):
            idx, top_x = torch.where(expert_mask[expert_idx])  # slot and token of each routed pair
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)  # (n_e, D)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


def load_balancing_loss(gate_logits: torch.Tensor) -> torch.Tensor:
    """Switch / Mixtral auxiliary loss over (layers·B·S, E) router logits: means over all tokens."""
    routing_weights = F.softmax(gate_logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, TOP_K, dim=-1)
    expert_mask = F.one_hot(selected_experts, EXPERTS)  # (T, k, E)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)  # (k, E): fraction of tokens per slot
    router_prob_per_expert = torch.mean(routing_weights, dim=0)  # (E,)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * EXPERTS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(DIM), RMSNorm(DIM)
        self.self_attn, self.block_sparse_moe = Attention(), SparseMoeBlock()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe, router_logits = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + moe, router_logits


class Mixtral(nn.Module):
    def __init__(self, n_layers: int = 2, theta: float = 10000.0) -> None:
        super().__init__()
        self.embed_tokens, self.norm = nn.Embedding(VOCAB, DIM), RMSNorm(DIM)
        self.layers = nn.ModuleList([Block() for _ in range(n_layers)])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, S, D)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        freqs = torch.outer(pos, self.inv_freq)  # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # (1, 1, S, hd)
        all_router_logits = []
        for layer in self.layers:
            x, router_logits = layer(x, cos, sin)
            all_router_logits.append(router_logits)
        logits = self.lm_head(self.norm(x))  # (B, S, V)
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return loss + AUX_COEF * load_balancing_loss(torch.cat(all_router_logits, dim=0))


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """(Mixtral, (input_ids, labels)): labels already shifted (next token), a few set to -100."""
    torch.manual_seed(seed)
    model = Mixtral()
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, VOCAB, (BATCH, seq_len), generator=g)
    labels = torch.roll(input_ids, -1, dims=1)
    labels[torch.rand(BATCH, seq_len, generator=g) < 0.1] = -100
    return model, (input_ids, labels)


MEMBER = Member("mixtral", "Mixtral MoE: router softmax, top-2 of 4 experts, torch.where per expert over the "
                "flattened tokens, index_add_ back; load-balancing aux loss as global means", factory,
                worlds=(2,))  # 4 ranks: tests/test_zoo_moe.py (its aux loss), the sweep
