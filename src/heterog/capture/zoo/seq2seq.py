"""The Transformer "base" of Vaswani et al. (NeurIPS 2017) for WMT14 En–De: d_model 512,
6+6 layers, 8 heads, FFN 2048, dropout 0.1, a shared 37,000-token BPE vocabulary whose
embedding is also the output projection (§3.4), sinusoidal positions (§3.5). Built on
torch.nn.Transformer, which adds a final LayerNorm to encoder and decoder: 63,084,544
parameters (the paper reports ≈65 M; the difference is its vocabulary handling)."""

from __future__ import annotations

import math

import torch
from torch import nn


class SinusoidalPositions(nn.Module):
    def __init__(self, dim: int, max_len: int = 4096):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
        table = torch.zeros(max_len, dim)
        table[:, 0::2] = torch.sin(pos * div)
        table[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[1]]


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab: int = 37000, d_model: int = 512, heads: int = 8, layers: int = 6,
                 ffn: int = 2048, dropout: float = 0.1):
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.embed = nn.Embedding(vocab, d_model)
        self.positions = SinusoidalPositions(d_model)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ffn, dropout, batch_first=True)
        for m in self.transformer.modules():
            # The paper drops out sub-layer outputs and embeddings (§5.4), not attention
            # probabilities; without it the fused attention kernel runs.
            if isinstance(m, nn.MultiheadAttention):
                m.dropout = 0.0
        self.generator = nn.Linear(d_model, vocab, bias=False)
        self.generator.weight = self.embed.weight   # tied (§3.4)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        s = self.dropout(self.positions(self.embed(src) * self.scale))
        t = self.dropout(self.positions(self.embed(tgt) * self.scale))
        n = tgt.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=tgt.device), diagonal=1)
        return self.generator(self.transformer(s, t, tgt_mask=causal, tgt_is_causal=True))


def transformer(vocab: int = 37000, d_model: int = 512, heads: int = 8, layers: int = 6,
                ffn: int = 2048) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(vocab, d_model, heads, layers, ffn)


def translation_batch(batch_size: int, seq_len: int | None, device, **args):
    """Source and shifted target ids of seq_len tokens each; targets are the next tokens."""
    vocab = args.get("vocab", 37000)
    src = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    tgt = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    return (src, tgt), torch.randint(0, vocab, (batch_size, seq_len), device=device)
