"""The operations AmoebaNet cells are made of, built from their genotype names."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm


def conv_bn(in_channels: int, out_channels: int, kernel: int | tuple[int, int] = 1,
            stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
            relu: bool = True) -> nn.Sequential:
    """An (optionally ReLU-preceded) bias-free convolution followed by batch normalisation."""
    modules: list[nn.Module] = [nn.ReLU()] if relu else []
    modules += [nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=False),
                DeferredBatchNorm(out_channels)]
    return nn.Sequential(*modules)


class FactorizedReduction(nn.Module):
    """Halve the resolution without discarding pixels: two strided 1x1 paths offset by one pixel."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 2:
            raise ValueError(f"a factorized reduction needs an even channel count (got {out_channels})")
        self.relu = nn.ReLU()
        self.path1 = nn.Conv2d(in_channels, out_channels // 2, 1, bias=False)
        self.path2 = nn.Conv2d(in_channels, out_channels // 2, 1, bias=False)
        self.bn = DeferredBatchNorm(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        # The second path sees the image shifted by one pixel (zero padded at the far edges), so
        # the two halves together cover every pixel; both give ceil(H/2) x ceil(W/2).
        shifted = F.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        return self.bn(torch.cat([self.path1(x[:, :, ::2, ::2]),
                                  self.path2(shifted[:, :, ::2, ::2])], dim=1))


class SeparableStack(nn.Module):
    """`depth` times: ReLU, depthwise k x k convolution, pointwise 1x1 convolution, batch norm."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, depth: int,
                 stride: int, dilation: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for i in range(depth):
            layers += [
                nn.ReLU(),
                nn.Conv2d(channels, channels, kernel, stride if i == 0 else 1,
                          padding=dilation * (kernel // 2), dilation=dilation, groups=channels,
                          bias=False),
                nn.Conv2d(channels, out_channels, 1, bias=False),
                DeferredBatchNorm(out_channels),
            ]
            channels = out_channels
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _bottleneck(in_channels: int, out_channels: int, core: list[nn.Module], reduced: int) -> nn.Sequential:
    """ReLU-1x1 down to `reduced` channels, the core convolution(s), ReLU-1x1 back up, with BNs."""
    return nn.Sequential(*conv_bn(in_channels, reduced), nn.ReLU(), *core, *conv_bn(reduced, out_channels))


def _conv_3x3(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    reduced = out_channels // 4
    if reduced < 1:
        return conv_bn(in_channels, out_channels, 3, stride, 1)
    core: list[nn.Module] = [nn.Conv2d(reduced, reduced, 3, stride, 1, bias=False),
                             DeferredBatchNorm(reduced)]
    return _bottleneck(in_channels, out_channels, core, reduced)


def _conv_1x7_7x1(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    reduced = out_channels // 4

    def factorized(channels_in: int, channels_out: int) -> list[nn.Module]:
        return [nn.Conv2d(channels_in, channels_out, (1, 7), (1, stride), (0, 3), bias=False),
                DeferredBatchNorm(channels_out), nn.ReLU(),
                nn.Conv2d(channels_out, channels_out, (7, 1), (stride, 1), (3, 0), bias=False),
                DeferredBatchNorm(channels_out)]

    if reduced < 1:
        return nn.Sequential(nn.ReLU(), *factorized(in_channels, out_channels))
    return _bottleneck(in_channels, out_channels, factorized(reduced, reduced), reduced)


class Pool(nn.Module):
    """Max or average pooling with 'same'-style output size ceil(H / stride), then a 1x1 if widths differ."""

    def __init__(self, kind: str, kernel: int, stride: int, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.kind, self.kernel, self.stride = kind, kernel, stride
        self.project = conv_bn(in_channels, out_channels, relu=False) if in_channels != out_channels else None

    def extra_repr(self) -> str:
        return f"{self.kind}, kernel={self.kernel}, stride={self.stride}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._pool(x)
        return x if self.project is None else self.project(x)

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel % 2:
            pad = self.kernel // 2
            if self.kind == "max":
                return F.max_pool2d(x, self.kernel, self.stride, pad)
            # Padding is excluded from the average, as with TensorFlow's 'SAME' average pooling.
            return F.avg_pool2d(x, self.kernel, self.stride, pad, count_include_pad=False)
        # An even window is padded at the far edges only, so the output is ceil(H / stride).
        height, width = x.shape[-2:]
        pad_h = max((-(-height // self.stride) - 1) * self.stride + self.kernel - height, 0)
        pad_w = max((-(-width // self.stride) - 1) * self.stride + self.kernel - width, 0)
        if self.kind == "max":
            x = F.pad(x, (0, pad_w, 0, pad_h), value=float("-inf"))
            return F.max_pool2d(x, self.kernel, self.stride)
        ones = F.pad(torch.ones_like(x[:1, :1]), (0, pad_w, 0, pad_h))
        x = F.pad(x, (0, pad_w, 0, pad_h))
        return F.avg_pool2d(x, self.kernel, self.stride) / F.avg_pool2d(ones, self.kernel, self.stride)


_SEPARABLE = re.compile(r"^(?:dil_(\d+)_)?separable_(\d)x\2_(\d+)$")
_POOL = re.compile(r"^(max|avg)_pool_(\d)x\2$")


def build_operation(name: str, in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Build the genotype operation `name` mapping `in_channels` to `out_channels` at `stride`."""
    if name == "none" and stride == 1 and in_channels == out_channels:
        return nn.Identity()
    if name in ("none", "1x1"):  # "none" must still match the cell's width and stride
        return conv_bn(in_channels, out_channels, 1, stride)
    if name == "3x3":
        return _conv_3x3(in_channels, out_channels, stride)
    if name == "1x7_7x1":
        return _conv_1x7_7x1(in_channels, out_channels, stride)
    match = _POOL.match(name)
    if match:
        return Pool(match.group(1), int(match.group(2)), stride, in_channels, out_channels)
    match = _SEPARABLE.match(name)
    if match:
        dilation = int(match.group(1) or 1)
        return SeparableStack(in_channels, out_channels, int(match.group(2)), int(match.group(3)),
                              stride, dilation)
    raise ValueError(f"unknown AmoebaNet operation {name!r}; known: none, 1x1, 3x3, 1x7_7x1, "
                     "max_pool_KxK, avg_pool_KxK, separable_KxK_N, dil_D_separable_KxK_N")
