"""The contract between models and the engine: a flat list of independently buildable layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe_cli.models.families import Task

Batch = Any  # a tensor or a tuple of tensors, split along dim 0 into micro-batches


def require(condition: bool, message: str) -> None:
    """Refuse a model's size parameter: ValueError(message) unless `condition` holds."""
    if not condition:
        raise ValueError(message)


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (YAML's true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_fraction(value: Any) -> bool:
    """Whether `value` is a number in [0, 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0


@dataclass(frozen=True)
class LayerSpec:
    """One pipeline layer: a name for plans and checkpoints, and a function that builds only it."""

    name: str
    build: Callable[[], nn.Module]


@dataclass
class ModelSpec:
    """A model as the engine sees it: layers that can be cut between any two, plus its loss."""

    name: str
    task: Task
    layers: list[LayerSpec]  # layer i takes what layer i-1 returns (a tensor or a tuple); layer 0 takes `inputs`
    loss: Callable[[Any, torch.Tensor], torch.Tensor]  # the mean over the units; micro-batches are weighted by units
    # (inputs, targets) of n examples: random values, valid token ids, the right shapes and dtypes; meta device too.
    example_batch: Callable[[int, torch.device | str], tuple[Batch, torch.Tensor]]
    units: Callable[[torch.Tensor], torch.Tensor | int] | None = None  # counts the units (None: examples, dim 0)
    tied: list[tuple[str, ...]] = field(default_factory=list)  # one tensor each, by "<layer index>.<parameter name>"
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def layer_names(self) -> list[str]:
        """The names of all layers, in order."""
        return [layer.name for layer in self.layers]

    def build_all(self) -> list[nn.Module]:
        """Build every layer (only sensible for models that fit one process)."""
        return [layer.build() for layer in self.layers]

    def factories(self) -> Sequence[Callable[[], nn.Module]]:
        """The per-layer build functions, in order."""
        return [layer.build for layer in self.layers]
