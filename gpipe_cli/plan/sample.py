"""The recipe's own training data as the plan times it: a mini-batch of typical shape, and what one costs to build."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_cli.models.describe import tensors_of
from gpipe_cli.recipe.schema import Recipe

DRAWS = 12  # mini-batches drawn: enough for a median shape, few enough to take a second


@dataclass(frozen=True)
class Sample:
    """One training mini-batch of typical shape, and the median seconds the loader took to build one."""

    inputs: Any
    targets: torch.Tensor
    build_seconds: float
    note: str  # e.g. "the recipe's data (median of 12 mini-batches: 32 x 17 tokens)"

    @property
    def examples(self) -> int:
        """Examples in the mini-batch."""
        return int(self.targets.shape[0])

    def take(self, n: int) -> tuple[Any, torch.Tensor]:
        """The first `n` examples (a micro-batch of the same padded shape)."""
        return _first(self.inputs, n), self.targets[:n]


def _first(value: Any, n: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:n]
    return type(value)(_first(v, n) for v in value)


def typical_batch(recipe: Recipe) -> Sample:
    """A full training mini-batch of median size from the recipe's data (raises what loading raises)."""
    from gpipe_cli.data.build import build_data_for

    loader = build_data_for(recipe, min_batch=1)
    batches, seconds = [], []
    it = loader.train_batches(epoch=0)
    for _ in range(min(DRAWS, loader.steps_per_epoch())):
        started = time.perf_counter()
        batches.append(next(it))
        seconds.append(time.perf_counter() - started)
    if not batches:
        raise ValueError("the training split has no mini-batch")
    full = max(b.size for b in batches)  # a short last batch is not typical
    batches = [b for b in batches if b.size == full]
    batches.sort(key=lambda b: sum(t.numel() for t in tensors_of(b.inputs)))
    median = batches[len(batches) // 2]
    shape = ", ".join(" x ".join(map(str, t.shape)) for t in tensors_of(median.inputs))
    note = (f"the recipe's data (the median of {len(batches)} mini-batches: {shape}; "
            f"{statistics.median(seconds) * 1e3:.1f} ms to build one)")
    assert median.targets is not None
    return Sample(median.inputs, median.targets, statistics.median(seconds), note)
