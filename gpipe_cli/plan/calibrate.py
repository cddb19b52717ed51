"""The engine's own cost beyond its layers', measured once: per layer call and per step."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.estimate.measure import build_pipeline, measure_engine
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import schedules, topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.plan.here import OptimizerOf
from gpipe_cli.plan.search import Factor
from gpipe_cli.sizing import torch_threads

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
                examples: Examples, optimizer: OptimizerOf | None = None,
                grad_clip: float | None = None, device: str = "cpu") -> dict[int, tuple[float, float]]:
    """Per M: seconds of a training step (its update included) of the whole model as one stage, and of the update."""
    inputs, targets = examples(batch)
    found = {}
    with torch_threads(threads):
        pipe = build_pipeline(spec, topology.local(device),
                              PipelineConfig(checkpoint="never", balance=(len(spec.layers),)), seed)
        update = optimizer(pipe.parameters()) if optimizer is not None else None
        try:
            for m in microbatches:
                figures = measure_engine(pipe, inputs, targets, batch, m, STEPS, WARMUP,
                                         optimizer=update, max_grad_norm=grad_clip)
                assert figures is not None  # a single process is rank 0
                # The fastest step: on a shared machine the others are slowed by neighbours, not by the engine.
                fastest = figures.step_times.index(min(figures.step_times))
                found[m] = figures.step_times[fastest], figures.optimizer_times[fastest]
        finally:
            pipe.close()
    return found


def overhead(layers: int, costs: Callable[[int], CostProfile], per_replica: int,
             measured: dict[int, float], update: float = 0.0) -> Overhead:
    """The engine's per-layer-call and per-step seconds: what the measured steps took beyond the simulated layers."""
    # The gap grows with M by the per-call cost and starts at the per-step cost, so it holds for any K and M.
    # `update`, the optimizer's seconds timed within each step, is taken as measured, not fitted: a few ms that the
    # noise of the fit's intercept hid (one device's plan said its step cost 0.0 ms).
    ms = sorted(measured)
    gaps = [measured[m] - update - simulate.simulate_step(costs(per_replica // m), [layers], per_replica, m, "gpipe",
                                                          "never", simulate.FREE).step_time for m in ms]
    if len(gaps) == 1:
        return Overhead(0.0, update + max(gaps[0], 0.0))
    # Least squares through the points: one noisy step (a shared machine) moves the line less.
    per_microbatch = max(statistics.linear_regression(ms, gaps).slope, 0.0)
    fixed = statistics.fmean(gaps) - per_microbatch * statistics.fmean(ms)
    return Overhead(per_microbatch / (2 * layers), update + max(fixed, 0.0))


def factors(balance: list[int], costs: Callable[[int], CostProfile], per_replica: int,
            measured: dict[int, float], known: float = 0.0, link: simulate.Link = simulate.FREE,
            rate: simulate.Rate | None = None, virtual: int = 1) -> dict[int, float]:
    """Per micro-batch size: the measured step (less `known` seconds) over the one simulated for the cut `balance`."""
    schedule = "interleaved" if virtual > 1 else "gpipe"
    ratios = {}
    for m, seconds in measured.items():
        predicted = simulate.simulate_step(costs(per_replica // m), balance, per_replica, m, schedule, "never", link,
                                           1.0, virtual, 0.0, rate).step_time
        ratios[per_replica // m] = max(seconds - known, 0.0) / predicted if predicted > 0 else 1.0
    return ratios


def by_size(ratios: dict[int, float]) -> Callable[[int], float]:
    """The ratio at any micro-batch size: linear in log(size) between the measured sizes, constant beyond."""
    points = sorted((math.log(size), ratio) for size, ratio in ratios.items())
    if not points:
        return lambda size: 1.0
    xs, ys = zip(*points)
    return lambda size: float(np.interp(math.log(max(size, 1)), xs, ys))


def by_shape(replicated: dict[int, float],
             staged: dict[int, dict[int, float]]) -> Factor:
    """The ratio at any (micro-batch size, K, D, V, schedule): the one measured on that shape, else the largest."""
    # Measured at K=1 (`replicated`) and at D=1 by V (`staged`); taking the largest elsewhere means a shape
    # not seen never wins on optimism.
    of_replicas = by_size(replicated)
    of_stages = {v: by_size(ratios) for v, ratios in staged.items()}

    def at(size: int, partitions: int, replicas: int, virtual: int = 1, schedule: str = "gpipe") -> float:
        if partitions == 1:
            return of_replicas(size)
        # Measured: GPipe (and what is priced like it, 1F1B: GPipe's actions in another order) at V = 1,
        # interleaved above.
        measured = schedules.get(schedule).priced_like == ("interleaved" if virtual > 1 else "gpipe")
        if replicas == 1 and measured and virtual in of_stages:
            return of_stages[virtual](size)
        return max([of_replicas(size), *(ratio(size) for ratio in of_stages.values())])
    return at
