"""AmoebaNet normal and reduction cells as pipeline layers that carry the two previous states."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from gpipe_cli.models.amoebanet.genotype import CellGenotype
from gpipe_cli.models.amoebanet.ops import FactorizedReduction, build_operation, conv_bn

# How the previous cell's input is matched to this cell's shape:
# "raw" - there is none (first cell after the stem convolution): use this cell's raw input;
# "identity" - it already has the right shape; "project" - a 1x1 convolution fixes the width;
# "reduce" - it has twice the resolution: a factorized reduction halves it.
PrevMode = Literal["raw", "identity", "project", "reduce"]


class Cell(nn.Module):
    """One AmoebaNet cell: takes (input, previous input, *carried) and returns (output, input, *carried).

    Carrying the previous input in the tuple is what lets the pipeline cut between any two cells.
    Any further tensors (the auxiliary head's logits) pass through untouched.
    """

    def __init__(self, genotype: CellGenotype, in_channels: int, prev_channels: int, channels: int,
                 reduction: bool, prev_mode: PrevMode) -> None:
        super().__init__()
        self.reduction = reduction
        self.prev_mode = prev_mode
        self.inputs = genotype.inputs
        self.concat = genotype.concat
        self.preprocess = conv_bn(in_channels, channels)
        self.prev_preprocess: nn.Module
        if prev_mode == "reduce":
            self.prev_preprocess = FactorizedReduction(prev_channels, channels)
        elif prev_mode == "project":
            self.prev_preprocess = conv_bn(prev_channels, channels)
        else:
            self.prev_preprocess = nn.Identity()
        # Width of every state: with no previous input, state 1 is the raw input (not projected).
        widths = [channels, in_channels if prev_mode == "raw" else channels] + [channels] * 5
        if prev_mode == "identity" and prev_channels != channels:
            raise ValueError(f"previous state has {prev_channels} channels, the cell needs {channels}")
        self.ops = nn.ModuleList()
        for name, index in zip(genotype.operations, genotype.inputs, strict=True):
            # Only operations reading the cell's two inputs are strided, as in the reference.
            stride = 2 if reduction and index < 2 else 1
            self.ops.append(build_operation(name, widths[index], channels, stride))
        for index in genotype.concat:
            if index < 2 and reduction:
                raise ValueError("a reduction cell cannot concatenate one of its unreduced inputs")
            if widths[index] != channels:
                raise ValueError(f"state {index} of the cell has {widths[index]} channels, not {channels}")
        self.out_channels = channels * len(genotype.concat)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction}, prev={self.prev_mode}, concat={self.concat}"

    def forward(self, states: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        carried: tuple[torch.Tensor, ...] = ()
        if isinstance(states, torch.Tensor):
            x, prev = states, states
        else:
            x, prev, carried = states[0], states[1], tuple(states[2:])
        if self.prev_mode == "raw":
            prev = x
        hidden = [self.preprocess(x), self.prev_preprocess(prev)]
        for k in range(0, len(self.ops), 2):
            left = self.ops[k](hidden[self.inputs[k]])
            right = self.ops[k + 1](hidden[self.inputs[k + 1]])
            hidden.append(left + right)
        out = torch.cat([hidden[i] for i in self.concat], dim=1)
        return (out, x, *carried)
