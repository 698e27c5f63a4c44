"""ViT-B/16 (Dosovitskiy et al., ICLR 2021) as torchvision builds it (`models/vision_transformer.py`):
patch 16, hidden 768, 12 layers, 12 heads, MLP 3072, 224×224 → 86,567,656 parameters
(torchvision model docs). Attention is heterog's fx-traceable SelfAttention, with the same
parameters as torchvision's nn.MultiheadAttention."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from heterog.capture.zoo.attention import SelfAttention


class MLPBlock(nn.Sequential):
    def __init__(self, dim: int, mlp_dim: int, dropout: float):
        super().__init__(
            nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim), nn.Dropout(dropout)
        )


class EncoderBlock(nn.Module):
    def __init__(self, heads: int, dim: int, mlp_dim: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = SelfAttention(dim, heads)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.self_attention(self.ln_1(x))) + x
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, seq_length: int, layers: int, heads: int, dim: int, mlp_dim: int, dropout: float):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            OrderedDict((f"encoder_layer_{i}", EncoderBlock(heads, dim, mlp_dim, dropout)) for i in range(layers))
        )
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        layers: int = 12,
        heads: int = 12,
        hidden: int = 768,
        mlp_dim: int = 3072,
        num_classes: int = 1000,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.patch_size = patch_size
        self.hidden = hidden
        self.conv_proj = nn.Conv2d(3, hidden, patch_size, patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        seq_length = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(seq_length, layers, heads, hidden, mlp_dim, dropout)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x)  # (n, hidden, h/p, w/p)
        x = x.flatten(2).permute(0, 2, 1)  # (n, patches, hidden)
        cls = self.class_token.expand(x.shape[0], -1, -1)
        x = self.encoder(torch.cat([cls, x], dim=1))
        return self.heads(x[:, 0])


def vit_b_16(num_classes: int = 1000, image_size: int = 224) -> VisionTransformer:
    return VisionTransformer(image_size=image_size, num_classes=num_classes)
