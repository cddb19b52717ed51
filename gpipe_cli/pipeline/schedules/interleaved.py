"""Interleaved 1F1B (Narayanan et al., 2021): V chunks of layers per stage, chunk c on stage c mod K."""

from __future__ import annotations

from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.schedules.base import Schedule, fill_drain_bubble, one_f_one_b


class Interleaved(Schedule):
    """K micro-batches per chunk in turn, forwards ahead; with V = 1 it is 1F1B."""

    name = "interleaved"
    chunked = True
    torch_counterpart = "ScheduleInterleaved1F1B"
    priced_like = "interleaved"

    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """Forward k runs chunk (k // K) mod V on micro-batch (k // KV) K + k mod K; backwards, chunks reversed."""
        if virtual == 1:
            return one_f_one_b(stage, stages, microbatches)
        total = microbatches * virtual

        def at(k: int, backward: bool) -> tuple[int, int]:
            group, within = divmod(k, stages * virtual)
            v = within // stages
            return group * stages + within % stages, (virtual - 1 - v if backward else v) * stages + stage

        warmup = min((stages - stage - 1) * 2 + (virtual - 1) * stages, total)  # deeper than 1F1B's: every chunk fed
        order: list[Step] = [(Kind.FWD, *at(k, False)) for k in range(warmup)]
        for j in range(total - warmup):
            order += [(Kind.FWD, *at(warmup + j, False)), (Kind.BWD, *at(j, True))]
        return order + [(Kind.BWD, *at(j, True)) for j in range(total - warmup, total)]

    def check(self, stages: int, microbatches: int, virtual: int) -> None:
        """V > 1 needs K >= 2 and M a multiple of K."""
        if virtual > 1 and stages < 2:
            raise ValueError(f"virtual_stages {virtual} needs at least 2 partitions (got {stages})")
        if virtual > 1 and microbatches % stages:
            raise ValueError(f"the interleaved schedule needs microbatches to be a multiple of partitions "
                             f"(got M={microbatches}, K={stages})")

    def bubble(self, stages: int, microbatches: int, virtual: int) -> float | None:
        """1F1B's at V = 1; simulated otherwise."""
        return fill_drain_bubble(stages, microbatches) if virtual == 1 else None
