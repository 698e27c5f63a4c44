"""VGG-19 (configuration E, no batch norm) as torchvision builds it (Simonyan & Zisserman,
ICLR 2015; torchvision `models/vgg.py`): 143,667,240 parameters (torchvision model docs)."""

from __future__ import annotations

import torch
from torch import nn

_CFG_E: list[int | str] = [
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    512,
    "M",
]


class VGG(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in _CFG_E:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                cin = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.avgpool(self.features(x))))


def vgg19(num_classes: int = 1000) -> VGG:
    return VGG(num_classes)
