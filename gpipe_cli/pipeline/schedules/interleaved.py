"""Interleaved 1F1B (Narayanan et al., 2021): V chunks of layers per stage, chunk c on stage c mod K.

The last stage's chunks feed the first stage's next ones; forwards go K micro-batches per chunk in
turn, with a deeper warm-up, and the fill and drain shrink V times. Compute order, K=2, V=2, M=2
(chunk after the slash):

    stage 0  F0/0 F1/0 F0/2 F1/2 B0/2 B1/2 B0/0 B1/0
    stage 1  F0/1 F1/1 F0/3 B0/3 F1/3 B1/3 B0/1 B1/1
"""

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
        """The k-th forward of a rank runs chunk (k // K) mod V on micro-batch (k // KV) K + k mod K; the
        k-th backward the same in reverse chunk order. A deeper warm-up than 1F1B's keeps every chunk fed."""
        if virtual == 1:
            return one_f_one_b(stage, stages, microbatches)
        total = microbatches * virtual

        def at(k: int, backward: bool) -> tuple[int, int]:
            group, within = divmod(k, stages * virtual)
            v = within // stages
            return group * stages + within % stages, (virtual - 1 - v if backward else v) * stages + stage

        warmup = min((stages - stage - 1) * 2 + (virtual - 1) * stages, total)
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
