"""The cut by measured time, checked inside the running pipeline before training starts.

Per-layer timings on one rank, alone, miss what a stage meets when every rank computes at once
(shared cores, memory bandwidth, the engine's own work), so the cut they give can leave one stage
far slower than another. A few untrained steps time each stage as it really runs; when one stage
computes more than `TOLERANCE` over another, every layer's cost is scaled by its stage's measured
over predicted compute and the model is cut again from these costs (the memory limits as before).
The trial steps use generated data, draw nothing from the run's random streams, and every rank builds
its layers afresh afterwards, so the run trains exactly as it would have without them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import partition
from gpipe_cli.pipeline.engine import Pipeline

TRIAL_STEPS = 3          # the first is dropped: it pays for allocator growth and the first messages
MIN_STEP_SECONDS = 0.5   # a step predicted to compute less: its imbalance costs less than the trial steps
TOLERANCE = 0.10         # stages' compute may differ this much before the model is cut again
GAIN = 0.05              # a new cut must promise a slowest stage at least this much faster


def worth_checking(costs: Sequence[float], balance: Sequence[int], microbatches: int) -> bool:
    """Whether a step's slowest stage, as predicted, computes long enough to be worth trial steps."""
    return max(partition.stage_costs(costs, balance)) * microbatches >= MIN_STEP_SECONDS


def stage_compute(pipe: Pipeline, spec: ModelSpec, batch_size: int, microbatches: int, seed: int,
                  steps: int = TRIAL_STEPS) -> list[float] | None:
    """Every stage's median compute seconds per step over untrained trial steps (on rank 0, None elsewhere).

    Gradients are left accumulated and deferred BatchNorm's statistics committed: build the layers again.
    """
    layout, device = pipe.layout, pipe.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        inputs, targets = spec.example_batch(batch_size, device)
        rows: list[list[float]] = []
        for step in range(steps):
            result = pipe.train_step(inputs if layout.is_first else None, targets if layout.is_last else None,
                                     step=step, microbatches=microbatches, measure_memory=False)
            if step and result.stats is not None:
                busy = {s.stage: s.busy for s in result.stats.stages if s.replica == 0}
                rows.append([busy[s] for s in range(layout.stages)])
    if not rows:
        return None
    return [statistics.median(column) for column in zip(*rows)]


def imbalance(seconds: Sequence[float]) -> float:
    """How much the slowest stage computes over the fastest, less one."""
    return max(seconds) / min(seconds) - 1.0 if min(seconds) > 0 else 0.0


def refined_costs(costs: Sequence[float], balance: Sequence[int], measured: Sequence[float]) -> list[float]:
    """Each layer's cost scaled by its stage's measured compute over its layers' predicted sum."""
    out: list[float] = []
    for r, seconds in zip(partition.stage_ranges(list(balance)), measured):
        predicted = sum(costs[i] for i in r)
        factor = seconds / predicted if predicted > 0 else 1.0
        out.extend(costs[i] * factor for i in r)
    return out


def better(refined: Sequence[float], balance: Sequence[int], candidate: Sequence[int]) -> bool:
    """Whether `candidate` promises a slowest stage at least `GAIN` faster than `balance` (both by `refined`)."""
    return max(partition.stage_costs(refined, candidate)) < (1.0 - GAIN) * max(partition.stage_costs(refined, balance))


def describe(measured: Sequence[float]) -> str:
    """The stages' compute per step, as the terminal shows it."""
    return ", ".join(f"{s:.2f} s" for s in measured)

