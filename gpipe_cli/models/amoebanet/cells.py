"""AmoebaNet cells cut into pipeline layers: the two inputs' preprocessing, then one layer per combination."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from gpipe_cli.models.amoebanet.genotype import CellGenotype
from gpipe_cli.models.amoebanet.ops import FactorizedReduction, build_operation, conv_bn

# How the previous cell's input is matched to this cell's shape:
# "raw" - there is none (first cell after the stem convolution): use this cell's raw input;
# "identity" - it already has the right shape; "project" - a 1x1 convolution fixes the width;
# "reduce" - it has twice the resolution: a factorized reduction halves it.
PrevMode = Literal["raw", "identity", "project", "reduce"]

COMBINATIONS = 5  # pairwise combinations per cell (`CellGenotype` checks it)

# A cell's layers pass one tuple along: (input, *live states, *carried). The cell's input rides along because
# the next cell reads it as its previous input; the live states are the hidden states a later combination reads
# or the output concatenates, known from the genotype, so a cut inside a cell sends no dead tensor; what follows
# them (the auxiliary head's logits) passes through untouched. Each layer knows from its place in the cell how
# many live states there are. The last combination concatenates the output and hands on (output, input,
# *carried), as a whole cell would.


def live_states(genotype: CellGenotype, prev_mode: PrevMode) -> list[tuple[int, ...]]:
    """The hidden states the tuple carries after the preprocessing and after each combination but the last."""
    # A state is live while a later combination reads it or the output will concatenate it. With no previous
    # input, state 1 is the cell's input itself, which the tuple carries anyway, so it is never sent twice.
    out = []
    for newest in range(1, 1 + COMBINATIONS):  # state 1 after the preprocessing, state 1 + k after combination k
        wanted = set(genotype.inputs[2 * (newest - 1):]) | set(genotype.concat)
        out.append(tuple(i for i in range(newest + 1) if i in wanted and not (i == 1 and prev_mode == "raw")))
    return out


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Preprocess(nn.Module):
    """A cell's first layer: (input, previous input, *carried) -> (input, *live states 0 and 1, *carried)."""

    def __init__(self, in_channels: int, prev_channels: int, channels: int, prev_mode: PrevMode,
                 live: tuple[int, ...]) -> None:
        super().__init__()
        self.prev_mode, self.live = prev_mode, live
        self.preprocess = conv_bn(in_channels, channels)
        self.prev_preprocess: nn.Module
        if prev_mode == "reduce":
            self.prev_preprocess = FactorizedReduction(prev_channels, channels)
        elif prev_mode == "project":
            self.prev_preprocess = conv_bn(prev_channels, channels)
        else:
            if prev_mode == "identity" and prev_channels != channels:
                raise ValueError(f"previous state has {prev_channels} channels, the cell needs {channels}")
            self.prev_preprocess = nn.Identity()

    def extra_repr(self) -> str:
        return f"prev={self.prev_mode}, live={self.live}"

    def forward(self, states: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        carried: tuple[torch.Tensor, ...] = ()
        if isinstance(states, torch.Tensor):  # straight after the stem: no previous input
            x, prev = states, states
        else:
            x, prev, carried = states[0], states[1], tuple(states[2:])
        hidden = {0: self.preprocess(x)}
        if 1 in self.live:
            hidden[1] = self.prev_preprocess(prev)
        return (x, *(hidden[i] for i in self.live), *carried)


class Combination(nn.Module):
    """One pairwise combination of a cell: its two operations on two live states, added."""

    # Reads (input, *live states, *carried); hands on the states live after it, or, as the cell's last layer,
    # (the concatenated output, input, *carried).

    def __init__(self, genotype: CellGenotype, index: int, widths: list[int], channels: int, reduction: bool,
                 prev_mode: PrevMode) -> None:
        super().__init__()
        self.index, self.raw = index, prev_mode == "raw"
        self.reads = genotype.inputs[2 * index:2 * index + 2]
        live = live_states(genotype, prev_mode)
        self.live_in = live[index]
        self.live_out = live[index + 1] if index + 1 < COMBINATIONS else ()
        self.concat = genotype.concat if index + 1 == COMBINATIONS else ()
        # Only operations reading the cell's two inputs are strided, as in the reference.
        self.left, self.right = (build_operation(genotype.operations[2 * index + side], widths[state], channels,
                                                 2 if reduction and state < 2 else 1)
                                 for side, state in enumerate(self.reads))

    def extra_repr(self) -> str:
        return f"state {2 + self.index} = {self.reads[0]} + {self.reads[1]}, live={self.live_in}"

    def forward(self, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, carried = states[0], tuple(states[1 + len(self.live_in):])
        hidden = dict(zip(self.live_in, states[1:1 + len(self.live_in)], strict=True))
        if self.raw:
            hidden[1] = x
        hidden[2 + self.index] = self.left(hidden[self.reads[0]]) + self.right(hidden[self.reads[1]])
        if self.concat:
            # The concatenation hands each state a strided slice of its gradient, where a state received across a
            # cut gets a contiguous one (autograd copies a leaf's): made contiguous here too, the BatchNorms before
            # it sum the same numbers in the same order wherever the model is cut.
            concatenated = torch.cat([_ContiguousGrad.apply(hidden[i]) for i in self.concat], dim=1)
            return (concatenated, x, *carried)
        return (x, *(hidden[i] for i in self.live_out), *carried)


def state_widths(genotype: CellGenotype, in_channels: int, channels: int, reduction: bool,
                 prev_mode: PrevMode) -> list[int]:
    """Every state's channels; refuses a genotype whose output would mix widths or resolutions."""
    # With no previous input, state 1 is the raw input (not projected).
    widths = [channels, in_channels if prev_mode == "raw" else channels] + [channels] * COMBINATIONS
    for index in genotype.concat:
        if index < 2 and reduction:
            raise ValueError("a reduction cell cannot concatenate one of its unreduced inputs")
        if widths[index] != channels:
            raise ValueError(f"state {index} of the cell has {widths[index]} channels, not {channels}")
    return widths
