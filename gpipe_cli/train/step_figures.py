"""A training step's time and where each stage spent it: figures that always add up.

Rank 0's loop times a step from its launch to the next step's, its own work between launches included;
each stage times its own part from the engine's timeline (device events on a GPU, the host clock on the
CPU). A stage can spend longer in a step than rank 0's wall time says: it may start its first step before
stage 0 does (which first sets up the run directory, the metrics file and its sinks) and wait for it there,
and on a GPU the host runs ahead of the device, most of all in the first step. A step cannot have been
shorter than any stage's time in it, so the step time is the longer of the two; each stage's `other` is
what its measured parts leave of it, so every stage's parts add up to the step time and the bubble (the
mean share of the step spent waiting) lies in [0, 1].
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


def step_figures(stats: StepStats, wall: float) -> StepFigures:
    """The step time (the longer of rank 0's `wall` time and every stage's own) and each stage's parts of it."""
    # Every stage of every replica bounds the step (they all ran it), not only replica 0, whose parts are shown.
    seconds = max([wall, *(s.step_time for s in stats.stages)])
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    for stage in stats.of_replica(0):
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
