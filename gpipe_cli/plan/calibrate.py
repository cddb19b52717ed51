"""The engine's own cost beyond its layers', measured once: per layer call and per step.

Per-layer seconds are timed layer by layer; the engine adds work every time an action runs a layer
(saved-tensor hooks, RNG states, statistics, Python) and per step (the optimizer, gathering
statistics). A single-stage pipeline is run here, in this process, at three micro-batch counts with
the same mini-batch: the gap between its measured step and the simulated one grows with M by the
per-call cost (a forward and a backward of every layer per micro-batch) and starts at the per-step
cost. This is `bench`'s calibration, split so that it holds for any K and M.

When several ranks share this machine, the same steps run on that many real replicas instead
(`plan.here.engine_steps`). There the measured step is a steady multiple of the simulated one at every
M (the ranks share cores, caches and memory, and wait on each other's collectives), so one factor,
the median of the ratios, scales every layer's seconds (`scaled`): one figure, little noise.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.estimate.measure import build_pipeline, measure_engine
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import topology

STEPS, WARMUP = 4, 1
Examples = Callable[[int], tuple[Any, torch.Tensor]]  # n -> (inputs, targets) of n examples


@dataclass(frozen=True)
class Overhead:
    """Seconds the engine adds: per layer of a compute action, and per step of the whole model on one stage."""

    action: float
    step: float


def counts(per_replica: int, least: int) -> list[int]:
    """The micro-batch counts timed: 1, the middle and the most (micro-batches of `least` examples)."""
    most = max(per_replica // least, 1)
    return sorted({1, max(round(most ** 0.5), 1), most})


def local_steps(spec: ModelSpec, batch: int, microbatches: list[int], seed: int, threads: int,
                examples: Examples) -> dict[int, float]:
    """Seconds of one step of the whole model as one stage in this process, at each micro-batch count."""
    inputs, targets = examples(batch)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    pipe = build_pipeline(spec, topology.local("cpu"), [len(spec.layers)], "gpipe", "never", seed)
    try:
        found = {}
        for m in microbatches:
            figures = measure_engine(pipe, inputs, targets, batch, m, STEPS, WARMUP)
            assert figures is not None  # a single process is rank 0
            # The fastest step: on a shared machine the others are slowed by neighbours, not by the engine.
            found[m] = min(figures.step_times)
    finally:
        pipe.close()
        torch.set_num_threads(previous)
    return found


def overhead(layers: int, costs: Callable[[int], CostProfile], per_replica: int, measured: dict[int, float],
             known: float = 0.0) -> Overhead:
    """The engine's per-layer-call and per-step seconds: what the measured steps of `per_replica` examples
    took beyond the simulated layers and the `known` seconds (the gradient all-reduce)."""
    gaps = []
    for m, seconds in sorted(measured.items()):
        predicted = simulate.simulate_step(costs(per_replica // m), [layers], per_replica, m, "gpipe", "never",
                                           simulate.Link(1e30, 0.0)).step_time
        gaps.append((float(m), seconds - predicted - known))
    if len(gaps) == 1:
        return Overhead(0.0, max(gaps[0][1], 0.0))
    # Least squares through the points: one noisy step (a shared machine) moves the line less.
    mean_m = sum(m for m, _ in gaps) / len(gaps)
    mean_g = sum(g for _, g in gaps) / len(gaps)
    slope = sum((m - mean_m) * (g - mean_g) for m, g in gaps) / sum((m - mean_m) ** 2 for m, _ in gaps)
    per_microbatch = max(slope, 0.0)
    return Overhead(per_microbatch / (2 * layers), max(mean_g - per_microbatch * mean_m, 0.0))


def factor(layers: int, costs: Callable[[int], CostProfile], per_replica: int, measured: dict[int, float],
           known: float = 0.0) -> float:
    """The median ratio of the measured steps (less the `known` seconds) to the simulated ones."""
    ratios = []
    for m, seconds in measured.items():
        predicted = simulate.simulate_step(costs(per_replica // m), [layers], per_replica, m, "gpipe", "never",
                                           simulate.Link(1e30, 0.0)).step_time
        ratios.append(max(seconds - known, 0.0) / predicted if predicted > 0 else 1.0)
    return statistics.median(ratios) if ratios else 1.0


def scaled(costs: Callable[[int], CostProfile], by: float) -> Callable[[int], CostProfile]:
    """Per-layer seconds multiplied by `by` (sizes and bytes unchanged)."""
    def at(size: int) -> CostProfile:
        profile = costs(size)
        layers = [dataclasses.replace(t, forward=t.forward * by, forward_nograd=t.forward_nograd * by,
                                      backward=t.backward * by) for t in profile.layers]
        return dataclasses.replace(profile, loss=profile.loss * by, layers=layers)
    return at
