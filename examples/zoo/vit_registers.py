"""A ViT with a cls token and register tokens (timm ``VisionTransformer(reg_tokens=4)`` style).

timm's layout with ``no_embed_class=True`` (as DINOv2-with-registers): the image is cut into
patches by ``nn.Conv2d(kernel_size=p, stride=p)``, ``flatten(2).transpose(1, 2)`` gives
(B, N_p, D), the learned position embedding is added to the patches only, and the cls token
and 4 register tokens (no positions) are concatenated before them: S = 1 + 4 + N_p. Pre-norm
blocks with a fused qkv and SDPA, the loss a cross-entropy on the cls token ``x[:, 0]``.
The sequence arises inside the graph, at the ``cat``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, hd)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, grid=(5, 15), patch_size: int = 3, in_chans: int = 3, num_classes: int = 11,
                 embed_dim: int = 32, depth: int = 2, num_heads: int = 4, reg_tokens: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, grid[0] * grid[1], embed_dim) * 0.02)  # patches only
        nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.reg_token, std=1e-6)
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos_embed  # no_embed_class: positions on the patches only
        to_cat = [self.cls_token.expand(x.shape[0], -1, -1), self.reg_token.expand(x.shape[0], -1, -1)]
        return torch.cat(to_cat + [x], dim=1)  # (B, 1 + R + N_p, D)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N_p, D)
        x = self.norm(self.blocks(self._pos_embed(x)))
        return F.cross_entropy(self.head(x[:, 0]), labels)  # cls-token pooling


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """Images of 5 × 15 patches of 3 × 3 pixels: 75 patches + cls + 4 registers = 80 tokens."""
    torch.manual_seed(seed)
    assert seq_len == SEQ_LEN, "the grid fixes the sequence: 1 + 4 + 5 * 15"
    model = VisionTransformer()
    return model, (torch.randn(BATCH, 3, 15, 45), torch.randint(0, 11, (BATCH,)))


MEMBER = Member("vit_registers", "timm ViT: conv patch embedding, cls + 4 register tokens cat before patches, cls loss",
                factory, worlds=(2, 4))
