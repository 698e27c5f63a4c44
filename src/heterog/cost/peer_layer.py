"""The transformer layer that the peer per-layer measurements ran (cost/data/peer_layers.json),
as a model file for `capture_model('…/peer_layer.py:megatron_gpt_layer', …)`.

Why not the zoo's GPT-2. The Aceso profiler (in eth-easl/sailor, the source of the peer
data) times the ops of Megatron-LM's GPT layer one by one, and its op table
(peer_calibration.json `op_times`) names them: layer norm, QKV GEMM, attention *score*
(baddbmm), *softmax* (Megatron's fused scale-mask-softmax, one kernel: its input and
output are the s×s scores), *dropout* on the probabilities, *context* (bmm), dense GEMM,
bias-dropout-add, layer norm, two MLP GEMMs around one fused bias-GELU kernel. That is an
unfused attention that writes and reads the s×s score matrix three times per pass, and a
GELU of one kernel. The zoo's GPT-2 runs fused SDPA attention (no s×s matrix: far less
memory traffic) and Hugging Face's eager tanh-GELU (eight element-wise kernels): scored
against the measured layers, it under-predicts a small-hidden layer (OPT-350, where the
s×s traffic dominates) and over-predicts a large one, and a per-type fit can only trade one
error for the other. Each op here is its own module, so each is its own node of the graph,
with its own roofline (a lumped node would take the max of its math and traffic, not the sum).

Sailor's own profiles (fp32 weights) time the same Megatron layer by module hooks; the
causal mask of Megatron's fused softmax is part of that one kernel and is not modelled.
This file is read by benchmarks/predict_gpu.py only; nothing in the package imports it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_SEQ_LEN = 2048


class _Score(nn.Module):
    """Q·Kᵀ for every head (Megatron: baddbmm with beta=0, which does not read its input)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.bmm(q, k.transpose(1, 2))


class _Softmax(nn.Module):
    """Megatron's FusedScaleMaskSoftmax. Its fused kernel (one pass: scale, causal mask and
    softmax) only takes fp16/bf16 input; on fp32 scores it falls back to three torch ops —
    scale (`input * scale`), mask (`masked_fill_(mask, -10000.0)`) and softmax
    (megatron/model/fused_softmax.py, `is_kernel_available` / `forward_torch_softmax`): three
    passes over the s×s scores forward and more backward. The peer data show it: modelled
    as one kernel, Aceso's fp32 softmax is predicted at 0.20-0.28 of its measured time on
    every type, its fp16 softmax at 0.9-1.3 (benchmarks/predict_gpu_diagnostics.py
    --peer-ops); as the three ops, at 0.61-0.93."""

    mask: torch.Tensor  # a buffer: the causal mask of the unfused form

    def __init__(self, fused: bool, positions: int):
        super().__init__()
        self.fused = fused
        if not fused:
            self.register_buffer("mask", torch.ones(positions, positions, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.softmax(scores, dim=-1)
        s = scores.shape[-1]
        return torch.softmax((scores * 0.125).masked_fill(self.mask[:s, :s], -10000.0), dim=-1)


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """Dropout as one kernel that writes the output and a one-byte mask (aten.native_dropout,
    what CUDA runs); F.dropout on CPU tensors decomposes into bernoulli, div and mul, whose
    traffic a GPU run does not have."""
    return torch.native_dropout(x, p, train)[0] if train and p > 0 else x


class _Dropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(x, self.p, self.training)


class _Context(nn.Module):
    def forward(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(probs, v)


class _DropoutAdd(nn.Module):
    """Megatron's bias-dropout-add: dropout on a branch, added to the residual stream."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + _dropout(x, self.p, self.training)


class MegatronLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float, fused_softmax: bool, positions: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.score = _Score()
        self.softmax = _Softmax(fused_softmax, positions)
        self.attn_dropout = _Dropout(dropout)
        self.context = _Context()
        self.dense = nn.Linear(hidden, hidden)
        self.attn_residual = _DropoutAdd(dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc_1 = nn.Linear(hidden, ffn)
        self.gelu = nn.GELU(approximate="tanh")
        self.fc_2 = nn.Linear(ffn, hidden)
        self.mlp_residual = _DropoutAdd(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, h = t.shape
        return t.view(b, s, self.heads, h // self.heads).transpose(1, 2).reshape(b * self.heads, s, h // self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        probs = self.attn_dropout(self.softmax(self.score(self._heads(q), self._heads(k))))
        ctx = self.context(probs, self._heads(v)).view(b, self.heads, s, h // self.heads).transpose(1, 2)
        x = self.attn_residual(self.dense(ctx.reshape(b, s, h)), x)
        return self.mlp_residual(self.fc_2(self.gelu(self.fc_1(self.ln_2(x)))), x)


class _Stack(nn.Module):
    def __init__(self, layers: int, **kw):
        super().__init__()
        self.layers = nn.ModuleList(MegatronLayer(**kw) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def megatron_gpt_layer(
    hidden: int = 1024,
    heads: int = 16,
    ffn: int | None = None,
    layers: int = 1,
    dropout: float = 0.1,
    fused_softmax: bool = True,
    positions: int = DEFAULT_SEQ_LEN,
) -> nn.Module:
    """`layers` Megatron-LM GPT layers (module paths `layers.0`, …) on hidden states.
    fused_softmax: the layer runs in fp16/bf16 (Megatron's fused softmax kernel); False for
    fp32 weights (its torch fallback)."""
    return _Stack(
        layers,
        hidden=hidden,
        heads=heads,
        ffn=ffn or 4 * hidden,
        dropout=dropout,
        fused_softmax=fused_softmax,
        positions=positions,
    )


def example_batch(batch_size: int, seq_len: int | None = None, hidden: int = 1024):
    x = torch.randn(batch_size, seq_len or DEFAULT_SEQ_LEN, hidden)
    return (x,), x


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A stand-in loss (the measured layers' gradients came from the rest of the model)."""
    return F.mse_loss(output, targets)
