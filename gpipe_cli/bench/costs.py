"""Measured per-layer costs of one micro-batch: forward (with and without a graph), backward, output size.

The schedule runs three kinds of compute per layer: a forward that builds the autograd graph, the
graph-less first forward of a rematerialised micro-batch, and the backward. They are timed separately
so that the balance and the simulator can charge each action what it really costs. Layers are built,
timed and freed one at a time, each fed the previous layer's real output.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import partition
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.stage import as_tensors, from_tensors


@dataclass(frozen=True)
class LayerTiming:
    """One layer's seconds for one micro-batch, and the bytes it hands to the next layer."""

    name: str
    forward: float         # forward building the autograd graph (also a recompute)
    forward_nograd: float  # the graph-less forward of a rematerialised micro-batch
    backward: float
    output_bytes: int


@dataclass
class CostProfile:
    """Per-layer costs of a model at one micro-batch size, plus the loss."""

    microbatch_size: int
    input_bytes: int
    loss: float            # loss forward + backward seconds (charged to the last stage)
    layers: list[LayerTiming] = field(default_factory=list)

    def balance_costs(self, checkpoint: str) -> list[float]:
        """Per-layer seconds of one micro-batch under a remat mode: the weights `balance_by_cost` splits."""
        remat = checkpoint != "never"
        out = [t.forward + t.backward + (t.forward_nograd if remat else 0.0) for t in self.layers]
        out[-1] += self.loss
        return out

    def balance(self, partitions: int, checkpoint: str) -> list[int]:
        """The min-max split of measured time into K contiguous stages."""
        return partition.balance_by_cost(self.balance_costs(checkpoint), partitions)

    def to_json(self) -> dict[str, Any]:
        """As plain data."""
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> CostProfile:
        """The inverse of `to_json`."""
        layers = [LayerTiming(**t) for t in data["layers"]]
        return CostProfile(int(data["microbatch_size"]), int(data["input_bytes"]), float(data["loss"]), layers)


def _nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # the first call pays for allocator growth and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _leaves(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in tensors]


def _time_backward(run: Callable[[], list[torch.Tensor]], repeats: int) -> float:
    """Median seconds of the backward alone (a fresh graph each time, built outside the clock)."""
    times = []
    for i in range(repeats + 1):
        roots = [o for o in run() if o.requires_grad]
        if not roots:
            return 0.0
        grads = [torch.ones_like(o) for o in roots]
        start = time.perf_counter()
        torch.autograd.backward(roots, grads)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(spec: ModelSpec, inputs: Any, targets: torch.Tensor, seed: int, repeats: int = 5) -> CostProfile:
    """Time every layer of `spec` on one micro-batch `inputs` (with its `targets` for the loss)."""
    factories = spec.factories()
    tensors, bare = as_tensors(inputs)
    size = int(tensors[0].shape[0]) if tensors and tensors[0] is not None else 1
    result = CostProfile(size, _nbytes(tensors), 0.0)
    for index in range(len(factories)):
        (layer,) = build_layers(factories, [index], seed)
        layer.train()

        def forward(layer: Any = layer, tensors: Any = tensors, bare: bool = bare) -> list[torch.Tensor]:
            out, _ = as_tensors(layer(from_tensors(_leaves(tensors), bare)))
            return [o for o in out if o is not None]

        def forward_nograd(forward: Callable[[], list[torch.Tensor]] = forward) -> None:
            with torch.no_grad():
                forward()

        fwd = _median_time(forward, repeats)
        nograd = _median_time(forward_nograd, repeats)
        bwd = _time_backward(forward, repeats)
        with torch.no_grad():
            output = layer(from_tensors(tensors, bare))
        tensors, bare = as_tensors(output)
        result.layers.append(LayerTiming(spec.layers[index].name, fwd, nograd, bwd, _nbytes(tensors)))
        del layer
    result.loss = _loss_seconds(spec, from_tensors(tensors, bare), targets, repeats)
    return result


def _loss_seconds(spec: ModelSpec, output: Any, targets: torch.Tensor, repeats: int) -> float:
    def run() -> None:
        out, bare = as_tensors(output)
        loss = spec.loss(from_tensors(_leaves(out), bare), targets)
        loss.backward()

    return _median_time(run, repeats)
