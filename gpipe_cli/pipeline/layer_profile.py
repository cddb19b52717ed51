"""Measure each layer's forward+backward time and activation memory on a sample micro-batch.

Layers are built, measured and freed one at a time, feeding each the previous layer's real output,
so profiling never needs the whole model in memory. The results feed `partition.balance_by_cost`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter
from gpipe_cli.pipeline.stage import as_tensors, from_tensors


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measured cost for one micro-batch."""

    seconds: float          # forward + backward, median of the repeats
    activation_bytes: int   # what autograd saves during its forward
    param_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(factories: Sequence[Callable[[], nn.Module]], sample: Any, seed: int = 0,
                   device: torch.device | str = "cpu", repeats: int = 3) -> list[LayerProfile]:
    """Profile every layer in order on `sample` (the model's input for one micro-batch)."""
    device = torch.device(device)
    x = as_tensors(sample)
    tensors, bare = [t.to(device) if t is not None else None for t in x[0]], x[1]
    out: list[LayerProfile] = []
    for index in range(len(factories)):
        (layer,) = build_layers(factories, [index], seed, device)
        layer.train()
        meter = ActivationMeter([*layer.parameters(), *layer.buffers()])
        times = []
        result: Any = None
        for _ in range(repeats + 1):  # the first run warms up allocators and kernels
            inputs = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None
                      for t in tensors]
            meter.reset_peak()
            _sync(device)
            start = time.perf_counter()
            with meter.saved_tensors():
                result = layer(from_tensors(inputs, bare))
            outputs, _ = as_tensors(result)
            roots = [o for o in outputs if o is not None and o.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
            _sync(device)
            times.append(time.perf_counter() - start)
            saved = meter.peak
            del roots
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        out.append(LayerProfile(statistics.median(times[1:]), saved, params))
        outputs, bare = as_tensors(result)
        tensors = [o.detach() if o is not None else None for o in outputs]
        del layer, result
    return out
