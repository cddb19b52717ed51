"""What evaluation measures for each task: accuracy for images; token accuracy and perplexity for text."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.losses import PAD_ID
from gpipe_cli.records import EvalFigures


def _logits(output: Any) -> torch.Tensor:
    # A classifier with an auxiliary head returns (logits, aux_logits); the first is the prediction.
    return output[0] if isinstance(output, tuple) else output


def correct_examples(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Examples whose top prediction is the label."""
    return (_logits(output).argmax(-1) == targets).sum()


def correct_tokens(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Non-padding target tokens predicted exactly."""
    keep = targets != PAD_ID
    return ((_logits(output).argmax(-1) == targets) & keep).sum()


def token_nll(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the non-padding target tokens, without label smoothing (nats)."""
    logits = _logits(output)
    # The training loss may be label-smoothed; perplexity is defined on the plain likelihood.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=PAD_ID, reduction="sum")


def metrics_for(spec: ModelSpec) -> dict[str, Callable[[Any, torch.Tensor], torch.Tensor | float]]:
    """The summed metrics the engine computes on the last stage for this model."""
    if spec.task == "image":
        return {"correct": correct_examples}
    return {"correct": correct_tokens, "nll": token_nll}


def summarise(sums: dict[str, float], units: float, baselines: Mapping[str, float] | None = None) -> EvalFigures:
    """Turn metric sums into the figures reported: accuracy, and for text the held-out perplexity.

    perplexity = exp(mean cross-entropy per target token); `baselines` (figures of the data the model
    should beat, such as `unigram_perplexity`) are reported next to it.
    """
    if not units:
        return {}
    out: EvalFigures = {"accuracy": sums["correct"] / units}
    if "nll" in sums:
        mean = sums["nll"] / units
        out["perplexity"] = math.exp(mean) if mean < 700 else math.inf  # exp overflows a float past ~709
    if baselines and "unigram_perplexity" in baselines:
        out["unigram_perplexity"] = baselines["unigram_perplexity"]
    return out
