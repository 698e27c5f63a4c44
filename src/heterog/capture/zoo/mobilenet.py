"""MobileNet-V2 (Sandler et al., CVPR 2018) as torchvision builds it (`models/mobilenetv2.py`,
width 1.0): 3,504,872 parameters (torchvision model docs)."""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn_act(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    # torchvision's Conv2dNormActivation: conv (no bias) → BN → ReLU6.
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(cin * expand_ratio))
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_act(cin, hidden, kernel=1))
        layers += [
            _conv_bn_act(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    # (expansion t, channels c, repeats n, first stride s), Table 2 of the paper.
    SETTING = [
        [1, 16, 1, 1],
        [6, 24, 2, 2],
        [6, 32, 3, 2],
        [6, 64, 4, 2],
        [6, 96, 3, 1],
        [6, 160, 3, 2],
        [6, 320, 1, 1],
    ]

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        features: list[nn.Module] = [_conv_bn_act(3, 32, stride=2)]
        cin = 32
        for t, c, n, s in self.SETTING:
            for i in range(n):
                features.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        features.append(_conv_bn_act(cin, 1280, kernel=1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.pool(self.features(x))))


def mobilenet_v2(num_classes: int = 1000) -> MobileNetV2:
    return MobileNetV2(num_classes)
