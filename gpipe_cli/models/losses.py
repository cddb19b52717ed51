"""Losses shared by the model families, each a mean over the micro-batch's units."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_ID = 0


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy over tokens, averaged over the non-padding target tokens."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    total = F.cross_entropy(flat, targets.reshape(-1), ignore_index=PAD_ID,
                            label_smoothing=label_smoothing, reduction="sum")
    # A micro-batch made only of padding has no units: return 0, not 0/0, so that the engine's
    # unit-weighted sum stays finite.
    return total / count_tokens(targets).clamp_min(1)


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    """The number of non-padding target tokens (the loss units of token models)."""
    return (targets != PAD_ID).sum()
