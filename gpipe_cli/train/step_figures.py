"""A training step's time and where each stage spent it: figures that always add up.

Two clocks time a step. The loop on rank 0 times it from its launch to the next step's launch (or to
its own figures at a boundary): that wall time also holds the loop's own work between launches (reading
the figures, writing records). Each stage times its own part from the engine's timeline, started by
its own launch: device events on a GPU, the host clock on the CPU. The two need not agree, and a stage
can spend longer in a step than rank 0's wall time says the step took:

- a stage that starts its first step before stage 0 does (rank 0 first sets up the run directory,
  the metrics file and its sinks) waits for stage 0 inside that step;
- on a GPU the host runs ahead of the device: the host may launch the next step while the device is
  still at work on this one, most of all in the first step, which carries the device's one-time costs.

A step cannot have been shorter than the time any stage spent in it, so the step time is the longer
of the wall time and every stage's own step time. In steady state on the CPU the wall time is the
longer (it holds every stage's span plus the loop's work) and is kept as it is. Each stage's measured
parts (compute, wait, comm, optimizer) come from its timeline, and `other` is the rest of the step
time, so every stage's parts add up to the step time and the bubble (the mean share of the step spent
waiting) lies in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

from gpipe_cli.pipeline.stats import PARTS, StepStats

_MEASURED = PARTS[:-1]  # every part but `other`, which is what is left of the step


@dataclass(frozen=True)
class StepFigures:
    """A step's time, and per stage of one replica the seconds of each part (`PARTS`), adding up to it."""

    seconds: float
    parts: dict[str, list[float]]

    @property
    def bubble(self) -> float:
        """The measured bubble: mean over stages of the time waiting for a peer / the step time."""
        waits = self.parts["wait"]
        return sum(waits) / len(waits) / self.seconds if waits and self.seconds > 0 else 0.0

    @property
    def idle(self) -> float:
        """Mean over stages of the share of the step not spent computing."""
        compute = self.parts["compute"]
        if not compute or self.seconds <= 0:
            return 0.0
        return sum(1.0 - c / self.seconds for c in compute) / len(compute)


def step_figures(stats: StepStats, wall: float, replica: int = 0) -> StepFigures:
    """The step time (the longer of rank 0's `wall` time and every stage's own) and each stage's parts of it."""
    # Every stage of every replica bounds the step (they all ran it), not only the replica whose parts are shown.
    seconds = max([wall, *(s.step_time for s in stats.stages)])
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    for stage in stats.of_replica(replica):
        measured = [max(stage.busy, 0.0), max(stage.wait, 0.0), max(stage.comm, 0.0), max(stage.optimizer, 0.0)]
        total = sum(measured)
        # Spans can overlap (a reduction on another GPU stream while the device computes): parts that
        # would exceed the step keep their proportions and fill it, so no stage reads more than the step.
        if total > seconds > 0:
            measured = [m * seconds / total for m in measured]
        for part, value in zip(_MEASURED, measured):
            parts[part].append(value)
        parts["other"].append(max(seconds - sum(measured), 0.0))
    return StepFigures(seconds, parts)
