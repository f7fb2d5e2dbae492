"""A video ViT over frames × patches as one sequence (VideoMAE / ViViT joint space-time style).

The clip (B, C, T, H, W) is cut into tubelets by ``nn.Conv3d(kernel_size=(t, p, p),
stride=(t, p, p))``; ``flatten(2).transpose(1, 2)`` lays the T/t × H/p × W/p tubelets out
as one sequence (B, T'·N_p, D); a fixed sinusoidal position table (VideoMAE's
``get_sinusoid_encoding_table``) is added; joint space-time attention over all of it
(every token attends to every frame's patches: the CP case); mean pooling, ``fc_norm`` and
a classification loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import BATCH, SEQ_LEN, Member
from .vit_registers import Block


def get_sinusoid_encoding_table(n_position: int, d_hid: int) -> torch.Tensor:
    pos = torch.arange(n_position, dtype=torch.float64)[:, None]
    j = torch.arange(d_hid)[None, :]
    angle = pos / torch.pow(10000.0, 2 * (j // 2) / d_hid)
    table = torch.where(j % 2 == 0, torch.sin(angle), torch.cos(angle))
    return table.float().unsqueeze(0)  # (1, n_position, d_hid)


class VideoTransformer(nn.Module):
    def __init__(self, frames: int = 10, size: int = 16, patch_size: int = 4, tubelet: int = 2, in_chans: int = 3,
                 embed_dim: int = 32, depth: int = 2, num_heads: int = 4, num_classes: int = 11) -> None:
        super().__init__()
        self.patch_embed = nn.Conv3d(in_chans, embed_dim, kernel_size=(tubelet, patch_size, patch_size),
                                     stride=(tubelet, patch_size, patch_size))
        num_patches = (frames // tubelet) * (size // patch_size) ** 2
        self.register_buffer("pos_embed", get_sinusoid_encoding_table(num_patches, embed_dim))
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads) for _ in range(depth)])
        self.fc_norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.scale = 1.0 / math.sqrt(embed_dim)

    def forward(self, video: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(video).flatten(2).transpose(1, 2)  # (B, T'·N_p, D)
        x = x + self.pos_embed.type_as(x)
        for blk in self.blocks:
            x = blk(x)
        return F.cross_entropy(self.head(self.fc_norm(x.mean(1))), labels)


def factory(seq_len: int = SEQ_LEN, seed: int = 0):
    """Clips of 10 frames of 16 × 16 pixels: 5 tubelets in time × 4 × 4 patches = 80 tokens."""
    torch.manual_seed(seed)
    assert seq_len == SEQ_LEN, "the clip size fixes the sequence: 5 * 16"
    model = VideoTransformer()
    return model, (torch.randn(BATCH, 3, 10, 16, 16), torch.randint(0, 11, (BATCH,)))


MEMBER = Member("video_vit", "VideoMAE: Conv3d tubelets flattened to frames x patches, joint attention, mean pool",
                factory)
