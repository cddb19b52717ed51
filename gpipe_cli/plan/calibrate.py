"""The engine's own cost beyond its layers', measured once: per layer call and per step.

Per-layer seconds are timed layer by layer; the engine adds work every time an action runs a layer
(saved-tensor hooks, RNG states, statistics, Python) and per step (the optimizer, gathering
statistics). A single-stage pipeline is run here, in this process, at three micro-batch counts with
the same mini-batch: the gap between its measured step and the simulated one grows with M by the
per-call cost (a forward and a backward of every layer per micro-batch) and starts at the per-step
cost. This is `bench`'s calibration, split so that it holds for any K and M.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.estimate.measure import build_pipeline, measure_engine
from gpipe_cli.estimate.subject import example_batch
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import topology

STEPS, WARMUP = 4, 1


@dataclass(frozen=True)
class Overhead:
    """Seconds the engine adds: per layer of a compute action, and per step of the whole model on one stage."""

    action: float
    step: float


def _step(spec: ModelSpec, batch: int, microbatches: int, seed: int) -> float:
    inputs, targets = example_batch(spec, batch, seed)
    pipe = build_pipeline(spec, topology.local("cpu"), [len(spec.layers)], "gpipe", "never", seed)
    try:
        figures = measure_engine(pipe, inputs, targets, batch, microbatches, STEPS, WARMUP)
    finally:
        pipe.close()
    assert figures is not None  # a single process is rank 0
    # The fastest step: on a shared machine the others are slowed by neighbours, not by the engine.
    return min(figures.step_times)


def overhead(spec: ModelSpec, costs: Callable[[int], CostProfile], batch: int, least: int, seed: int,
             threads: int) -> Overhead:
    """The engine's per-layer-call and per-step seconds for `spec` on one stage of this machine."""
    most = max(batch // least, 1)
    counts = sorted({1, max(round(most ** 0.5), 1), most})
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gaps = []
        for m in counts:
            measured = _step(spec, batch, m, seed)
            predicted = simulate.simulate_step(costs(batch // m), [len(spec.layers)], batch, m, "gpipe", "never",
                                               simulate.Link(1e30, 0.0)).step_time
            gaps.append((float(m), measured - predicted))
    finally:
        torch.set_num_threads(previous)
    if len(gaps) == 1:
        return Overhead(0.0, max(gaps[0][1], 0.0))
    # Least squares through the points: one noisy step (a shared machine) moves the line less.
    mean_m = sum(m for m, _ in gaps) / len(gaps)
    mean_g = sum(g for _, g in gaps) / len(gaps)
    slope = sum((m - mean_m) * (g - mean_g) for m, g in gaps) / sum((m - mean_m) ** 2 for m, _ in gaps)
    per_microbatch = max(slope, 0.0)
    return Overhead(per_microbatch / (2 * len(spec.layers)), max(mean_g - per_microbatch * mean_m, 0.0))
