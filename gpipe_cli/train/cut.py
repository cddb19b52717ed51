"""Where `balance: auto` cuts: the min-max per-layer cost among the cuts whose every stage fits memory.

A stage's memory comes from the one memory model (`memory_model.stage_footprint`): it depends on the
stage's place in the schedule (earlier stages hold more micro-batches in flight), so `fits` takes the
stage index as well as its layers. When no cut fits, the refusal names the smallest per-stage peak any
cut reaches, so the user sees how far the machine is from enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpipe_cli import memory_model as mm
from gpipe_cli.pipeline import partition, placement, schedules
from gpipe_cli.units import human_bytes


@dataclass
class StageMemory:
    """Predicted bytes of the stage holding layers [start, stop) at each place of a K-stage pipeline."""

    figures: mm.ModelFigures
    stages: int
    batch_size: int   # the mini-batch of one replica
    microbatches: int
    schedule: str
    checkpoint: str
    bytes_per_param: float
    capacity: float   # what one rank may use
    capacity_note: str = ""  # e.g. "22.1 GiB of available RAM shared by 4 ranks"
    offload: str = "none"    # pipeline.offload
    _known: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)
    _chunked: dict[tuple[int, tuple[int, ...]], float] = field(default_factory=dict, repr=False)

    def need(self, stage: int, start: int, stop: int) -> float:
        """Bytes the stage needs at its peak (weights, gradients, optimizer state and activations)."""
        key = (stage, start, stop)
        if key not in self._known:
            self._known[key] = mm.stage_footprint(self.figures, start, stop, stage, self.stages, self.batch_size,
                                                  self.microbatches, self.schedule, self.checkpoint,
                                                  self.bytes_per_param, self.offload).total_bytes
        return self._known[key]

    def fits(self, stage: int, start: int, stop: int) -> bool:
        """Whether the stage fits its rank's memory."""
        return self.need(stage, start, stop) <= self.capacity

    def needs(self, balance: Sequence[int]) -> list[float]:
        """Every stage's bytes under `balance` (K x V chunks when interleaved, chunk c on stage c mod K)."""
        return mm.stage_needs(self.figures, balance, self.batch_size, self.microbatches, self.schedule,
                              self.checkpoint, self.bytes_per_param, len(balance) // self.stages, self._chunked,
                              self.offload)

    def smallest_peak(self, costs: Sequence[float] = (), virtual: int = 1) -> tuple[float, list[int], int]:
        """The smallest largest-stage need over every cut (interleaved: the least a search from the min-max
        cut of `costs` finds), a cut reaching it, and its largest stage."""
        if virtual > 1:
            assert costs, "an interleaved search starts from the min-max cut of the layers' costs"
            balance = partition.least_memory(partition.balance_by_cost(costs, self.stages * virtual), self.needs)
        else:
            found = partition.min_max_split(len(self.figures.layers), self.stages, self.need)
            assert found is not None  # every stage has a finite need
            balance = found[1]
        needs = self.needs(balance)
        return max(needs), balance, needs.index(max(needs))


def within_memory(costs: Sequence[float], memory: StageMemory, virtual: int = 1) -> tuple[list[int], bool]:
    """The min-max cut of `costs` (K x `virtual` chunks) whose every stage fits, and whether memory moved it
    off the unconstrained one (interleaved: the fastest fitting cut `partition.interleaved_within` finds).

    Raises NoCutFits when no cut fits.
    """
    chunks = memory.stages * virtual
    owners = placement.cut_owners(memory.stages, virtual, schedules.get(memory.schedule).placement)
    free = partition.balance_stages(costs, chunks, owners, memory.microbatches)
    if max(memory.needs(free)) <= memory.capacity:
        return free, False
    if virtual > 1:
        found = partition.interleaved_within(costs, chunks, memory.needs, memory.capacity)
    else:
        found = partition.balance_within(costs, memory.stages, memory.fits)
    if found is None:
        raise NoCutFits(memory, costs, virtual)
    return found, True


class NoCutFits(Exception):
    """No contiguous cut of the model fits the memory each rank has."""

    def __init__(self, memory: StageMemory, costs: Sequence[float], virtual: int = 1) -> None:
        self.memory, self.costs, self.virtual = memory, list(costs), virtual
        super().__init__(self.line())

    def line(self) -> str:
        """The refusal, with the numbers and what to change."""
        m = self.memory
        peak, balance, stage = m.smallest_peak(self.costs, self.virtual)
        change = "raise pipeline.microbatches or pipeline.partitions"
        change += "" if m.checkpoint == "always" else ", or set pipeline.checkpoint: always"
        where = f" ({m.capacity_note})" if m.capacity_note else ""
        what = f"{m.stages} stages" if self.virtual == 1 else \
            f"{m.stages} x {self.virtual} chunks (interleaved)"
        reach = "any cut reaches" if self.virtual == 1 else "the search found"
        return (f"the plan does not fit this machine: no cut of the {len(m.figures.layers)} layers into "
                f"{what} fits; the smallest per-stage peak {reach} is {human_bytes(peak)} "
                f"(balance {balance}: stage {stage} needs {human_bytes(peak)}), and each rank has "
                f"{human_bytes(m.capacity)}{where}. Lower data.batch_size, {change}")
