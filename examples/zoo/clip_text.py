"""A CLIP text encoder (Hugging Face ``modeling_clip.py``: ``CLIPTextTransformer``), plain PyTorch.

Token plus learned position embeddings (``position_ids = arange(S)``), pre-LayerNorm blocks
with a causal mask built as CLIP builds it (an (S, S) ``-inf`` upper triangle added to the
scores), ``quick_gelu`` MLPs, a final LayerNorm, and the pooled output taken at the first
end-of-text token as Hugging Face writes it:
``last_hidden_state[arange(B), (input_ids.to(torch.int) == eos_token_id).int().argmax(dim=-1)]``;
then the text projection, and a regression loss (MSE) against a fixed target embedding.
Rows end at different lengths; one is padded with the end-of-text token itself (CLIP's tokenizer
pads with it), so the first of several is taken; another is padded with 0. Under ring_cp the
argmax and the read of the pooled row are finished over the ranks (rules/order.py,
rules/getitem.py): nothing is gathered.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member

DIM, HEADS, HIDDEN, VOCAB, PROJ, EOS, MAX_POS = 32, 4, 88, 101, 24, 100, 128


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class CLIPAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim, self.scale = DIM // HEADS, (DIM // HEADS) ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, hidden_states: torch.Tensor, causal_attention_mask: torch.Tensor) -> torch.Tensor:
        B, S, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, S, HEADS, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_attention_mask, scale=self.scale)
        return self.out_proj(o.transpose(1, 2).reshape(B, S, DIM))


class CLIPEncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.layer_norm1, self.layer_norm2 = CLIPAttention(), nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, hidden_states: torch.Tensor, causal_attention_mask: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), causal_attention_mask)
        return hidden_states + self.fc2(quick_gelu(self.fc1(self.layer_norm2(hidden_states))))


class CLIPTextModelWithProjection(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.token_embedding, self.position_embedding = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_POS, DIM)
        self.register_buffer("position_ids", torch.arange(MAX_POS).expand((1, -1)), persistent=False)
        self.layers = nn.ModuleList(CLIPEncoderLayer() for _ in range(n_layers))
        self.final_layer_norm = nn.LayerNorm(DIM)
        self.text_projection = nn.Linear(DIM, PROJ, bias=False)
        self.eos_token_id = EOS

    def forward(self, input_ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seq_length = input_ids.shape[-1]
        position_ids = self.position_ids[:, :seq_length]
        hidden_states = self.token_embedding(input_ids) + self.position_embedding(position_ids)
        # causal: -inf above the diagonal (built out of place: an in-place triu_ keeps the whole (S, S)
        # construction alive on every rank after the ring op has replaced the mask)
        mask = torch.full((seq_length, seq_length), float("-inf"), device=input_ids.device).triu(1)
        causal_attention_mask = mask[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_attention_mask)
        last_hidden_state = self.final_layer_norm(hidden_states)
        pooled_output = last_hidden_state[
            torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device),
            (input_ids.to(dtype=torch.int, device=last_hidden_state.device) == self.eos_token_id).int().argmax(dim=-1),
        ]
        text_embeds = self.text_projection(pooled_output)
        return F.mse_loss(text_embeds, target)


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """(model, (input_ids, target)): rows ending in EOS at S - 1, ~0.6 S (then padded with EOS) and ~0.2 S
    (then padded with 0); target a fixed (B, PROJ) embedding."""
    torch.manual_seed(seed)
    model = CLIPTextModelWithProjection()
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(1, EOS, (BATCH, seq_len), generator=g)
    ends = (seq_len - 1, seq_len * 6 // 10, seq_len // 5)
    input_ids[0, ends[0]] = EOS
    input_ids[1, ends[1]:] = EOS  # the tokenizer's padding is the end-of-text token: the first one counts
    input_ids[2, ends[2]] = EOS
    input_ids[2, ends[2] + 1:] = 0
    target = torch.randn(BATCH, PROJ, generator=g)
    return model, (input_ids, target)


MEMBER = Member("clip_text", "Hugging Face CLIPTextTransformer: causal -inf triangle mask, final LayerNorm, pooled "
                "at the first EOS ((ids == eos).int().argmax(-1), several EOS per row), text projection, MSE "
                "(argmax and the read finished over the ranks, no gather)", factory,
                zero_grads=("k_proj.bias",))  # q · b_k shifts a row of scores: softmax-invariant
