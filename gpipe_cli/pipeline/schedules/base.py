"""What a schedule is: how one stage orders its forwards and backwards, and what it promises in theory."""

from __future__ import annotations

from abc import ABC, abstractmethod

from gpipe_cli.pipeline.actions import Kind, Step


class Schedule(ABC):
    """A pipeline schedule: each stage's order of forwards and backwards (BWD, or BWD_INPUT then BWD_WEIGHT)."""

    name = ""
    chunked = False  # runs V > 1 chunks of layers per stage
    placement = "loop"  # which stage runs which chunk (pipeline/placement.py)
    torch_counterpart: str | None = None  # torch.distributed.pipelining's class with the same order, if any
    priced_like: str | None = None  # the schedule whose measured steps price this one in `gpipe plan`
    bubble_formula: str | None = None  # the bubble's closed form, when it has one

    @abstractmethod
    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """One stage's forwards and backwards, in order."""

    def check(self, stages: int, microbatches: int, virtual: int) -> None:
        """Refuse, with one line, K stages x V chunks and M micro-batches this schedule cannot run."""
        if virtual > 1 and not self.chunked:
            raise ValueError(f"virtual_stages {virtual} needs schedule 'interleaved' (got '{self.name}')")

    def bubble(self, stages: int, microbatches: int, virtual: int) -> float | None:
        """The idle fraction in closed form (fill-drain's, where `bubble_formula` states it), or None to simulate."""
        return fill_drain_bubble(stages, microbatches) if self.bubble_formula else None


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Step]:
    """1F1B's order (PipeDream-flush): a warm-up of forwards, then one forward and one backward in turn."""
    warmup = min(stages - stage - 1, microbatches)
    order: list[Step] = [(Kind.FWD, i, stage) for i in range(warmup)]
    for j in range(microbatches - warmup):
        order += [(Kind.FWD, warmup + j, stage), (Kind.BWD, j, stage)]
    return order + [(Kind.BWD, j, stage) for j in range(microbatches - warmup, microbatches)]


def fill_drain_bubble(stages: int, microbatches: int) -> float:
    """(K-1)/(M+K-1): GPipe's and 1F1B's idle fraction on equal stages."""
    return (stages - 1) / (microbatches + stages - 1)
