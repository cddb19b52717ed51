"""GPipe (Huang et al., 2019): every forward, then every backward in reverse (fill, then drain)."""

from __future__ import annotations

from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.schedules.base import Schedule


class GPipe(Schedule):
    """Fill-drain: M micro-batches in flight on every stage."""

    name = "gpipe"
    torch_counterpart = "ScheduleGPipe"
    priced_like = "gpipe"
    bubble_formula = "(K-1)/(M+K-1)"

    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """Forwards in order, backwards in reverse."""
        return [(Kind.FWD, i, stage) for i in range(microbatches)] + \
            [(Kind.BWD, i, stage) for i in reversed(range(microbatches))]
