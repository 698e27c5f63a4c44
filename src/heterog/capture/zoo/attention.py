"""Multi-head attention with nn.MultiheadAttention's parameters (a fused 3d×d input
projection and a d×d output projection, both with bias) but written so torch.fx can trace it:
nn.MultiheadAttention's forward branches on tensor properties, which fx cannot follow, and the
executor splits models with fx. The scores run through scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.causal = heads, causal
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.in_proj(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=self.causal)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder output (same parameter
    count as nn.MultiheadAttention: the 3d×d input projection split into q and kv parts)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        kv = self.kv_proj(memory).unflatten(-1, (2, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1])
        return self.out_proj(out.transpose(1, 2).flatten(2))
