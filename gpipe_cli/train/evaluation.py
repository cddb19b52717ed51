"""What evaluation measures for each task: accuracy for images, token accuracy for text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpipe_cli.models.base import ModelSpec


def _logits(output: Any) -> torch.Tensor:
    # AmoebaNet with its auxiliary head returns (logits, aux_logits); the first is the prediction.
    return output[0] if isinstance(output, tuple) else output


def correct_examples(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Examples whose top prediction is the label."""
    return (_logits(output).argmax(-1) == targets).sum()


def correct_tokens(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Non-padding target tokens predicted exactly."""
    keep = targets != 0
    return ((_logits(output).argmax(-1) == targets) & keep).sum()


def metrics_for(spec: ModelSpec) -> dict[str, Callable[[Any, torch.Tensor], torch.Tensor | float]]:
    """The summed metrics the engine computes on the last stage for this model."""
    return {"correct": correct_examples if spec.task == "image" else correct_tokens}


def summarise(sums: dict[str, float], units: float) -> dict[str, float]:
    """Turn metric sums into the figures reported (accuracy over examples or tokens)."""
    return {"accuracy": sums["correct"] / units} if units else {}
