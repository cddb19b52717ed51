"""Where `balance: auto` cuts, and the check of a cut by measured time inside the running pipeline."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpipe_cli import memory_model as mm
from gpipe_cli.pipeline import partition, placement, schedules
from gpipe_cli.units import human_bytes

if TYPE_CHECKING:
    from gpipe_cli.models.base import ModelSpec
    from gpipe_cli.pipeline.engine import Pipeline

TRIAL_STEPS = 3          # the first is dropped: it pays for allocator growth and the first messages
MIN_STEP_SECONDS = 0.5   # a step predicted to compute less: its imbalance costs less than the trial steps
TOLERANCE = 0.10         # stages' compute may differ this much before the model is cut again
GAIN = 0.05              # a new cut must promise a slowest stage at least this much faster


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
        key = (stage, start, stop)  # the stage's place counts: earlier stages hold more micro-batches in flight
        if key not in self._known:
            self._known[key] = mm.stage_total(self.figures, [range(start, stop)], stage, self.stages,
                                              self.batch_size, self.microbatches, self.schedule, self.checkpoint,
                                              self.bytes_per_param, self.offload)
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
        """The smallest largest-stage need over every cut, a cut reaching it and its largest stage."""
        if virtual > 1:
            assert costs, "an interleaved search starts from the min-max cut of the layers' costs"
            balance = partition.least_memory(partition.balance_by_cost(costs, self.stages * virtual), self.needs)
        else:
            found = partition.min_max_split(len(self.figures.layers), self.stages, self.need,
                                            mm.weights_floor(self.figures, self.bytes_per_param))
            assert found is not None  # every stage has a finite need
            balance = found[1]
        needs = self.needs(balance)
        return max(needs), balance, needs.index(max(needs))


def within_memory(costs: Sequence[float], memory: StageMemory, virtual: int = 1) -> tuple[list[int], bool]:
    """The min-max cut of `costs` (K x `virtual` chunks) whose every stage fits, and whether memory moved it."""
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


def worth_checking(costs: Sequence[float], balance: Sequence[int], microbatches: int) -> bool:
    """Whether a step's slowest stage, as predicted, computes long enough to be worth trial steps."""
    return max(partition.stage_costs(costs, balance)) * microbatches >= MIN_STEP_SECONDS


def stage_compute(pipe: Pipeline, spec: ModelSpec, batch_size: int, microbatches: int, seed: int,
                  steps: int = TRIAL_STEPS) -> list[float] | None:
    """Each stage's median compute seconds over trial steps (rank 0, else None); build the layers anew after."""
    layout, device = pipe.layout, pipe.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        inputs, targets = spec.example_batch(batch_size, device)
        rows: list[list[float]] = []
        for step in range(steps):
            result = pipe.train_step(inputs if layout.is_first else None, targets if layout.is_last else None,
                                     step=step, microbatches=microbatches, measure_memory=False)
            if step and result.stats is not None:
                busy = {s.stage: s.busy for s in result.stats.stages if s.replica == 0}
                rows.append([busy[s] for s in range(layout.stages)])
    if not rows:
        return None
    return [statistics.median(column) for column in zip(*rows)]


def imbalance(seconds: Sequence[float]) -> float:
    """How much the slowest stage computes over the fastest, less one."""
    return max(seconds) / min(seconds) - 1.0 if min(seconds) > 0 else 0.0


def refined_costs(costs: Sequence[float], balance: Sequence[int], measured: Sequence[float]) -> list[float]:
    """Each layer's cost scaled by its stage's measured compute over its layers' predicted sum."""
    out: list[float] = []
    for r, seconds in zip(partition.stage_ranges(list(balance)), measured):
        predicted = sum(costs[i] for i in r)
        factor = seconds / predicted if predicted > 0 else 1.0
        out.extend(costs[i] * factor for i in r)
    return out


def better(refined: Sequence[float], balance: Sequence[int], candidate: Sequence[int]) -> bool:
    """Whether `candidate` promises a slowest stage at least `GAIN` faster than `balance` (both by `refined`)."""
    return max(partition.stage_costs(refined, candidate)) < (1.0 - GAIN) * max(partition.stage_costs(refined, balance))


def shifted(balance: Sequence[int], measured: Sequence[float]) -> list[int] | None:
    """The cut with one layer moved off the stage that computed most onto its less busy neighbour (None: it has one)."""
    slowest = max(range(len(measured)), key=measured.__getitem__)
    if balance[slowest] < 2:
        return None
    sides = [s for s in (slowest - 1, slowest + 1) if 0 <= s < len(balance)]
    out = list(balance)
    out[slowest] -= 1
    out[min(sides, key=measured.__getitem__)] += 1
    return out


def describe(measured: Sequence[float]) -> str:
    """The stages' compute per step, as the terminal shows it."""
    return ", ".join(f"{s:.2f} s" for s in measured)
