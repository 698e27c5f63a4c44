"""NASNet-A Mobile (Zoph et al., CVPR 2018), 4 cells per stack @ 1056 penultimate filters,
following the Keras reference implementation (`keras/applications/nasnet.py`,
NASNetMobile: stem 32 filters, filter multiplier 2, no skip of reduction inputs). Keras
reports 5,326,716 parameters, of which 36,738 are BatchNorm moving statistics; those are
buffers in PyTorch, so this model has Keras's 5,289,978 trainable parameters.

Keras "same" padding on stride-2 layers is asymmetric for even inputs (`correct_pad`), so
strided separable convolutions and poolings pad explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=1e-3, momentum=0.0003)  # Keras momentum 0.9997


def _correct_pad(x: torch.Tensor, k: int) -> tuple[int, int, int, int]:
    """Keras correct_pad as F.pad's (left, right, top, bottom)."""
    adj_h, adj_w = 1 - x.shape[2] % 2, 1 - x.shape[3] % 2
    return (k // 2 - adj_w, k // 2, k // 2 - adj_h, k // 2)


class SeparableConv(nn.Module):
    """Keras SeparableConv2D without bias: depthwise k×k, then pointwise 1×1."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1):
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, k, stride, padding=k // 2 if stride == 1 else 0, groups=cin, bias=False)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class SepBlock(nn.Module):
    """relu → separable conv (stride s) → BN → relu → separable conv → BN."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1):
        super().__init__()
        self.k, self.stride = k, stride
        self.sep1 = SeparableConv(cin, cout, k, stride)
        self.bn1 = _bn(cout)
        self.sep2 = SeparableConv(cout, cout, k)
        self.bn2 = _bn(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(x)
        if self.stride == 2:
            x = F.pad(x, _correct_pad(x, self.k))
        x = F.relu(self.bn1(self.sep1(x)))
        return self.bn2(self.sep2(x))


class Adjust(nn.Module):
    """Make the previous cell's output p match this cell: halve its resolution (two offset
    1×1 paths, concatenated) or project its channels; identity if it already matches."""

    def __init__(self, cin: int, filters: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode == "reduce":
            self.path1 = nn.Conv2d(cin, filters // 2, 1, bias=False)
            self.path2 = nn.Conv2d(cin, filters // 2, 1, bias=False)
            self.bn = _bn(2 * (filters // 2))
        elif mode == "project":
            self.conv = nn.Conv2d(cin, filters, 1, bias=False)
            self.bn = _bn(filters)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        if self.mode == "identity":
            return p
        p = F.relu(p)
        if self.mode == "project":
            return self.bn(self.conv(p))
        p1 = self.path1(p[:, :, ::2, ::2])
        p2 = self.path2(F.pad(p, (0, 1, 0, 1))[:, :, 1:, 1:][:, :, ::2, ::2])
        return self.bn(torch.cat([p1, p2], 1))


class _Cell(nn.Module):
    def __init__(self, x_shape: tuple[int, int], p_shape: tuple[int, int] | None, filters: int):
        super().__init__()
        cx, lx = x_shape
        if p_shape is None:
            mode, cp = "identity", cx
        elif p_shape[1] != lx:
            mode, cp = "reduce", 2 * (filters // 2)
        elif p_shape[0] != filters:
            mode, cp = "project", filters
        else:
            mode, cp = "identity", filters
        self.adjust = Adjust(p_shape[0] if p_shape else cx, filters, mode)
        self.cp = cp
        self.conv = nn.Conv2d(cx, filters, 1, bias=False)
        self.bn = _bn(filters)

    def _h(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(F.relu(x)))


class NormalCell(_Cell):
    def __init__(self, x_shape, p_shape, filters: int):
        super().__init__(x_shape, p_shape, filters)
        f, cp = filters, self.cp
        self.left1, self.right1 = SepBlock(f, f, 5), SepBlock(cp, f, 3)
        self.left2, self.right2 = SepBlock(cp, f, 5), SepBlock(cp, f, 3)
        self.left5 = SepBlock(f, f, 3)
        self.out_channels = cp + 5 * f

    def forward(self, x: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        p = self.adjust(x if p is None else p)
        h = self._h(x)
        x1 = self.left1(h) + self.right1(p)
        x2 = self.left2(p) + self.right2(p)
        x3 = F.avg_pool2d(h, 3, 1, 1, count_include_pad=False) + p
        x4 = 2 * F.avg_pool2d(p, 3, 1, 1, count_include_pad=False)
        x5 = self.left5(h) + h
        return torch.cat([p, x1, x2, x3, x4, x5], 1)


class ReductionCell(_Cell):
    def __init__(self, x_shape, p_shape, filters: int):
        super().__init__(x_shape, p_shape, filters)
        f, cp = filters, self.cp
        self.left1, self.right1 = SepBlock(f, f, 5, 2), SepBlock(cp, f, 7, 2)
        self.right2 = SepBlock(cp, f, 7, 2)
        self.right3 = SepBlock(cp, f, 5, 2)
        self.left5 = SepBlock(f, f, 3)
        self.out_channels = 4 * f

    def forward(self, x: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        p = self.adjust(x if p is None else p)
        h = self._h(x)
        h3 = F.pad(h, _correct_pad(h, 3))
        x1 = self.left1(h) + self.right1(p)
        x2 = F.max_pool2d(h3, 3, 2) + self.right2(p)
        x3 = F.avg_pool2d(h3, 3, 2) + self.right3(p)
        x4 = F.avg_pool2d(x1, 3, 1, 1, count_include_pad=False) + x2
        x5 = self.left5(x1) + F.max_pool2d(h3, 3, 2)
        return torch.cat([x2, x3, x4, x5], 1)


class NASNet(nn.Module):
    def __init__(
        self,
        penultimate_filters: int = 1056,
        num_blocks: int = 4,
        stem_filters: int = 32,
        multiplier: int = 2,
        num_classes: int = 1000,
    ):
        super().__init__()
        f = penultimate_filters // 24
        self.stem_conv = nn.Conv2d(3, stem_filters, 3, 2, bias=False)
        self.stem_bn = _bn(stem_filters)
        cells: list[nn.Module] = []
        x_shape, p_shape = (stem_filters, 0), None

        def add(cell_type, filters: int) -> None:
            nonlocal x_shape, p_shape
            cell = cell_type(x_shape, p_shape, filters)
            cells.append(cell)
            level = x_shape[1] + (1 if cell_type is ReductionCell else 0)
            x_shape, p_shape = (cell.out_channels, level), x_shape

        add(ReductionCell, f // multiplier**2)
        add(ReductionCell, f // multiplier)
        for stack in range(3):
            if stack > 0:
                add(ReductionCell, f * multiplier**stack)
            for _ in range(num_blocks):
                add(NormalCell, f * multiplier**stack)
        self.cells = nn.ModuleList(cells)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten(1)
        self.classifier = nn.Linear(x_shape[0], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem_bn(self.stem_conv(x))
        p = None
        for cell in self.cells:
            x, p = cell(x, p), x
        return self.classifier(self.flatten(self.pool(F.relu(x))))


def nasnet_mobile(num_classes: int = 1000) -> NASNet:
    return NASNet(num_classes=num_classes)
