"""1F1B (PipeDream-flush, Narayanan et al., 2021): GPipe's work, each backward as early as it can run.

It keeps at most K - stage micro-batches in flight, with GPipe's bubble:

    stage 0  F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1  .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2  .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..
"""

from __future__ import annotations

from gpipe_cli.pipeline.actions import Step
from gpipe_cli.pipeline.schedules.base import Schedule, one_f_one_b


class OneFOneB(Schedule):
    """A warm-up of K - stage - 1 forwards, then one forward and one backward in turn."""

    name = "1f1b"
    torch_counterpart = "Schedule1F1B"
    priced_like = "gpipe"  # GPipe's actions in another order
    bubble_formula = "(K-1)/(M+K-1)"

    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """1F1B's order."""
        return one_f_one_b(stage, stages, microbatches)
