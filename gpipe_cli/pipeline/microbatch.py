"""Scatter a mini-batch into M micro-batches along dim 0, and gather outputs back."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from gpipe_cli.pipeline.config import sizes

__all__ = ["Batch", "batch_size", "gather", "offsets", "scatter", "sizes"]

Batch = Any  # a tensor or a tuple/list of tensors


def batch_size(batch: Batch) -> int:
    """The number of examples (dim 0) of a tensor or of the first tensor of a tuple."""
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    return int(first.shape[0])


def scatter(batch: Batch, chunks: int) -> list[Batch]:
    """Split a batch into `chunks` micro-batches; uneven sizes are allowed."""
    n = batch_size(batch)
    split = sizes(n, chunks)
    if isinstance(batch, torch.Tensor):
        return list(batch.split(split))
    parts = [t.split(split) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n
             else [t] * chunks for t in batch]
    return [tuple(p[i] for p in parts) for i in range(chunks)]


def gather(outputs: Sequence[Batch]) -> Batch:
    """Concatenate micro-batch outputs back into one batch."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    return tuple(torch.cat([o[i] for o in outputs]) for i in range(len(first)))


def offsets(split: Sequence[int], start: int = 0) -> list[int]:
    """The global index of each micro-batch's first example."""
    return list(itertools.accumulate(split[:-1], initial=start)) if split else []
