"""1F1B (PipeDream-flush, Narayanan et al., 2021): GPipe's work, each backward as early as it can run."""

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
