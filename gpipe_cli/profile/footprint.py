"""A stage's memory predicted from per-layer figures, by walking the engine's schedule for that stage.

The walk holds what the engine holds: after a rematerialised forward, the micro-batch's boundary
input; after any other forward or a recompute, its input, saved activations and output; a backward
frees its micro-batch. It is the measured accounting's rule applied to measured per-layer figures, so
it can price models far too large to run here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from gpipe_cli.pipeline import microbatch
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.schedule import Kind
from gpipe_cli.profile.figures import ModelFigures


@dataclass(frozen=True)
class Footprint:
    """Predicted bytes of one stage."""

    params: int
    weights_bytes: float   # parameters, gradients and optimizer state
    stored_bytes: float
    peak_bytes: float
    layers: int = 0

    @property
    def total_bytes(self) -> float:
        """What the device needs."""
        return self.weights_bytes + self.peak_bytes


@functools.lru_cache(maxsize=4096)
def _walk(schedule: str, stage: int, stages: int, microbatches: int, checkpoint: str) -> tuple[tuple[int, ...], ...]:
    """Per backward-phase point and per peak point, how many micro-batches are held whole or as inputs.

    Returns (kind, whole, inputs) triples: kind 0 marks a "stored" reading, 1 a "peak" reading.
    """
    remat = sched.remat_plan(checkpoint, sched.forward_order(schedule, stage, stages, microbatches))
    whole: set[int] = set()
    inputs: set[int] = set()
    points = []
    for action in sched.build(schedule, stage, stages, microbatches, checkpoint):
        mb = action.microbatch
        if action.kind == Kind.RECOMPUTE or (action.kind == Kind.BWD and mb not in remat):
            points.append((0, len(whole), len(inputs)))
        if action.kind == Kind.FWD:
            (inputs if mb in remat else whole).add(mb)
        elif action.kind == Kind.RECOMPUTE:
            inputs.discard(mb)
            whole.add(mb)
        elif action.kind == Kind.BWD:
            whole.discard(mb)
        points.append((1, len(whole), len(inputs)))
    return tuple(sorted(set(points)))


def _footprint(boundary: float, saved: float, output: float, params: int, stage: int, stages: int,
               microbatches: int, schedule: str, checkpoint: str, bytes_per_param: float) -> Footprint:
    whole = boundary + saved + output
    stored = peak = 0.0
    for kind, n_whole, n_inputs in _walk(schedule, stage, stages, microbatches, checkpoint):
        held = n_whole * whole + n_inputs * boundary
        if kind == 0:
            stored = max(stored, held)
        peak = max(peak, held)
    return Footprint(params, params * bytes_per_param, stored, peak)


def _boundary(figures: ModelFigures, start: int, size: int) -> float:
    return figures.input.at(size) if start == 0 else figures.layers[start - 1].output.at(size)


def _output(figures: ModelFigures, stop: int, size: int) -> float:
    # The last stage's output is its loss, a scalar.
    return 0.0 if stop == len(figures.layers) else figures.layers[stop - 1].output.at(size)


def stage_footprint(figures: ModelFigures, start: int, stop: int, stage: int, stages: int, batch_size: int,
                    microbatches: int, schedule: str, checkpoint: str, bytes_per_param: float) -> Footprint:
    """The predicted memory of the stage holding layers [start, stop)."""
    size = max(microbatch.sizes(batch_size, microbatches))
    layers = figures.layers[start:stop]
    return _footprint(_boundary(figures, start, size), sum(layer.saved.at(size) for layer in layers),
                      _output(figures, stop, size), sum(layer.params for layer in layers), stage, stages,
                      microbatches, schedule, checkpoint, bytes_per_param)


def greedy_fit(figures: ModelFigures, stages: int, budget: float, batch_size: int, microbatches: int,
               schedule: str, checkpoint: str, bytes_per_param: float) -> list[Footprint] | None:
    """Cut the layers into at most `stages` stages, each as long as it fits `budget`; None if they do not fit.

    Filling each stage as far as it fits, in order, uses the fewest stages a contiguous cut can,
    because a stage never needs less memory when it gains a layer.
    """
    n = len(figures.layers)
    size = max(microbatch.sizes(batch_size, microbatches))
    out: list[Footprint] = []
    start = 0
    for stage in range(stages):
        if start == n:
            break
        boundary = _boundary(figures, start, size)
        saved, params, stop = 0.0, 0, start
        best: Footprint | None = None
        while stop < n:
            layer = figures.layers[stop]
            trial = _footprint(boundary, saved + layer.saved.at(size), _output(figures, stop + 1, size),
                               params + layer.params, stage, stages, microbatches, schedule, checkpoint,
                               bytes_per_param)
            if trial.total_bytes > budget:
                break
            best, stop = trial, stop + 1
            saved, params = saved + layer.saved.at(size), params + layer.params
        if best is None:
            return None
        out.append(dataclasses.replace(best, layers=stop - start))
        start = stop
    return out if start == n else None
