"""Small models the executor's equivalence tests and the demo train on CPU in seconds.
No BatchNorm or dropout (so distributed and single-process training agree exactly), and
torch.fx-traceable (the executor splits them with fx)."""

from __future__ import annotations

import torch
from torch import nn


def mlp(in_features: int = 32, hidden: int = 64, layers: int = 3, out_features: int = 10) -> nn.Sequential:
    """`layers` Linear layers with ReLU between them."""
    if layers < 1:
        raise ValueError(f"layers must be ≥ 1, found {layers}")
    dims = [in_features] + [hidden] * (layers - 1) + [out_features]
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class ToyCNN(nn.Module):
    """Two conv blocks and a classifier for 3×32×32 images (CIFAR-10 sized)."""

    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(2 * width * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        return self.fc(self.flatten(x))


def toy_cnn(width: int = 16, num_classes: int = 10) -> ToyCNN:
    return ToyCNN(width, num_classes)


def vector_batch(batch_size: int, seq_len: int | None, device, **args):
    x = torch.randn(batch_size, args.get("in_features", 32), device=device)
    return (x,), torch.randint(0, args.get("out_features", 10), (batch_size,), device=device)
