"""Small fx-traceable models for the executor tests (loaded by ranks as 'file.py:name').

Each name is a zoo-style entry (build / example_batch / loss), as heterog.capture.zoo accepts.

No BatchNorm or dropout, so distributed training can match single-process training exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Entry:
    default_seq_len = None

    def __init__(self, builder, batch):
        self._builder, self._batch = builder, batch

    def build(self, **args):
        return self._builder(**args)

    __call__ = build

    def example_batch(self, batch_size, seq_len=None, device="cpu", **args):
        return self._batch(batch_size)

    def loss(self, output, targets):
        return F.cross_entropy(output, targets)


class MLP(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class ResMLP(nn.Module):
    """Loose ops (a residual add, a method call) between leaf modules."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.block = nn.Sequential(nn.Linear(24, 24), nn.Tanh())
        self.out = nn.Linear(24, 4)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.block(h)
        return self.out(h.relu())


class TinyVGG(nn.Module):
    """Convolutions (cheap parameters, most compute) then large linear layers."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Linear(8 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def _vectors(batch_size):
    return (torch.randn(batch_size, 16),), torch.randint(0, 4, (batch_size,))


def _images(batch_size):
    return (torch.randn(batch_size, 3, 8, 8),), torch.randint(0, 5, (batch_size,))


mlp = _Entry(lambda **a: MLP(**a), _vectors)
resmlp = _Entry(lambda **a: ResMLP(), _vectors)
tiny_vgg = _Entry(lambda **a: TinyVGG(), _images)


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it (runs only unsplit)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > -1e9:
            h = torch.tanh(h)
        return self.fc2(h)


class Repeat(nn.Module):
    """One module called twice: the second call is node 'shared#1'."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.shared(torch.relu(self.shared(x))))


branchy = _Entry(lambda **a: Branchy(), _vectors)


def fixed_vectors(batch_size, step):
    """User data for `run(data=...)`: a fixed table read by step (the same on every rank)."""
    table = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16).sin()
    rows = (torch.arange(batch_size) + step * batch_size) % 64
    return (table[rows],), rows % 4
