"""The Transformer "base" of Vaswani et al. (NeurIPS 2017) for WMT14 En–De: d_model 512,
6+6 post-norm layers, 8 heads, FFN 2048 with ReLU, dropout 0.1 on sub-layer outputs and
embeddings (§5.4; none on attention probabilities, so the fused attention kernel runs), a
shared 37,000-token BPE vocabulary whose embedding is also the output projection (§3.4),
sinusoidal positions (§3.5). Laid out like torch.nn.Transformer (which adds a final
LayerNorm to the encoder and the decoder) but fx-traceable: 63,084,544 parameters (the
paper reports ≈65 M)."""

from __future__ import annotations

import math

import torch
from torch import nn

from heterog.capture.zoo.attention import CrossAttention, SelfAttention
from heterog.capture.zoo.base import sequence_length


class SinusoidalPositions(nn.Module):
    table: torch.Tensor  # a buffer

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


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, ffn: int, dropout: float):
        super().__init__(nn.Linear(dim, ffn), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn, dim))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.self_attn = SelfAttention(dim, heads)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, ffn, dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout1(self.self_attn(x)))
        return self.norm2(x + self.dropout2(self.ff(x)))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.self_attn = SelfAttention(dim, heads, causal=True)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(dim)
        self.cross_attn = CrossAttention(dim, heads)
        self.dropout2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, ffn, dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout1(self.self_attn(x)))
        x = self.norm2(x + self.dropout2(self.cross_attn(x, memory)))
        return self.norm3(x + self.dropout3(self.ff(x)))


class Seq2SeqTransformer(nn.Module):
    def __init__(
        self,
        vocab: int = 37000,
        d_model: int = 512,
        heads: int = 8,
        layers: int = 6,
        ffn: int = 2048,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.scale = math.sqrt(d_model)
        self.embed = nn.Embedding(vocab, d_model)
        self.positions = SinusoidalPositions(d_model)
        self.src_dropout = nn.Dropout(dropout)
        self.tgt_dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, heads, ffn, dropout) for _ in range(layers))
        self.encoder_norm = nn.LayerNorm(d_model)
        self.decoder = nn.ModuleList(DecoderLayer(d_model, heads, ffn, dropout) for _ in range(layers))
        self.decoder_norm = nn.LayerNorm(d_model)
        self.generator = nn.Linear(d_model, vocab, bias=False)
        self.generator.weight = self.embed.weight  # tied (§3.4)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.src_dropout(self.positions(self.embed(src) * self.scale))
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.encoder_norm(memory)
        x = self.tgt_dropout(self.positions(self.embed(tgt) * self.scale))
        for layer in self.decoder:
            x = layer(x, memory)
        return self.generator(self.decoder_norm(x))


def transformer(
    vocab: int = 37000, d_model: int = 512, heads: int = 8, layers: int = 6, ffn: int = 2048, dropout: float = 0.1
) -> Seq2SeqTransformer:
    """dropout=0 makes training deterministic (the executor's equivalence tests)."""
    return Seq2SeqTransformer(vocab, d_model, heads, layers, ffn, dropout)


def translation_batch(batch_size: int, seq_len: int | None, device, **args):
    """Source and shifted target ids of seq_len tokens each; targets are the next tokens."""
    vocab = args.get("vocab", 37000)
    seq_len = sequence_length(seq_len)
    src = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    tgt = torch.randint(0, vocab, (batch_size, seq_len), device=device)
    return (src, tgt), torch.randint(0, vocab, (batch_size, seq_len), device=device)
