"""AmoebaNet layers around the cells: the stem convolution, the classifier and the auxiliary head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm
from gpipe_cli.pipeline.dropout import Dropout

# The reference scales the auxiliary head's 128- and 768-channel convolutions by 0.4.
AUX_SCALING = 0.4


def he_built(make: Callable[..., nn.Module], *args: Any) -> nn.Module:
    """`make(*args)` with He-normal (fan-out) initialisation of every convolution, as in the reference."""
    module = make(*args)
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return module


class Stem(nn.Module):
    """A stride-2 unpadded 3x3 convolution and batch norm on the image."""

    def __init__(self, out_channels: int, in_channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, bias=False)
        self.bn = DeferredBatchNorm(out_channels)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(images))


class Classifier(nn.Module):
    """ReLU, global average pooling, dropout and a linear layer: the logits, then any auxiliary logits carried."""

    def __init__(self, in_channels: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.dropout = Dropout(dropout)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x = F.relu(states[0]).mean(dim=(2, 3))
        logits = self.fc(self.dropout(x))
        carried = tuple(states[2:])
        return (logits, *carried) if carried else logits


class AuxHead(nn.Module):
    """The auxiliary classifier; appends its logits to the carried states: (x, prev) -> (x, prev, aux)."""

    # The reference's last convolution spans the whole pooled map, so its kernel is sized for the nominal image
    # size; other image sizes are average-pooled to that grid first.

    def __init__(self, in_channels: int, num_classes: int, spatial: int) -> None:
        super().__init__()
        # The side of the map after the 5x5 stride-3 pooling (no pooling below 5 px).
        self.grid = (spatial - 5) // 3 + 1 if spatial >= 5 else spatial
        hidden, features = int(128 * AUX_SCALING), int(768 * AUX_SCALING)
        self.proj = nn.Conv2d(in_channels, hidden, 1, bias=False)
        self.bn0 = DeferredBatchNorm(hidden)
        self.conv = nn.Conv2d(hidden, features, self.grid, bias=False)
        self.bn1 = DeferredBatchNorm(features)
        self.fc = nn.Linear(features, num_classes)

    def forward(self, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = F.relu(states[0])
        if min(x.shape[-2:]) >= 5:
            x = F.avg_pool2d(x, 5, stride=3)
        x = F.relu(self.bn0(self.proj(x)))
        if tuple(x.shape[-2:]) != (self.grid, self.grid):
            x = F.adaptive_avg_pool2d(x, self.grid)
        x = F.relu(self.bn1(self.conv(x)))
        return (*states, self.fc(x.flatten(1)))
