"""Where `balance: auto` cuts, and the check of a cut by measured time inside the running pipeline."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpipe_cli import memory_model as mm
from gpipe_cli.pipeline import partition, placement, schedules
from gpipe_cli.units import human_bytes

if TYPE_CHECKING:
    from gpipe_cli.data import Batch
    from gpipe_cli.pipeline.engine import Pipeline

TRIAL_STEPS = 3          # the first is dropped: it pays for allocator growth and the first messages
MIN_STEP_SECONDS = 0.5   # a step predicted to compute less: its imbalance costs less than the trial steps
TOLERANCE = 0.10         # stages' compute may differ this much before the model is cut again
GAIN = 0.05              # a new cut must promise a slowest stage at least this much faster


def within_memory(costs: Sequence[float], memory: mm.CutMemory, virtual: int = 1) -> tuple[list[int], bool]:
    """The min-max cut of `costs` (K x `virtual` chunks) whose every stage fits, and whether memory moved it."""
    owners = placement.cut_owners(memory.stages, virtual, schedules.get(memory.schedule).placement)
    free = partition.balance_stages(costs, memory.stages * virtual, owners, memory.microbatches)
    if max(memory.needs(free)) <= memory.capacity:
        return free, False
    found = memory.within(costs, virtual)
    if found is None:
        raise NoCutFits(memory, costs, virtual)
    return found, True


class NoCutFits(Exception):
    """No contiguous cut of the model fits the memory each rank has."""

    def __init__(self, memory: mm.CutMemory, costs: Sequence[float], virtual: int = 1) -> None:
        self.memory, self.costs, self.virtual = memory, list(costs), virtual
        super().__init__(self.line())

    def line(self, batch_key: str = "data.batch_size") -> str:
        """The refusal, with the numbers and what to change."""
        m = self.memory
        found = m.least(self.costs, self.virtual)
        assert found is not None  # every stage has a finite need
        needs = m.needs(found[1])
        peak, balance, stage = max(needs), found[1], needs.index(max(needs))
        where = f" ({m.capacity_note})" if m.capacity_note else ""
        what = f"{m.stages} stages" if self.virtual == 1 else \
            f"{m.stages} x {self.virtual} chunks (interleaved)"
        reach = "any cut reaches" if self.virtual == 1 else "the search found"
        return (f"the plan does not fit this machine: no cut of the {len(m.figures.layers)} pipeline layers into "
                f"{what} fits; the smallest per-stage peak {reach} is {human_bytes(peak)} "
                f"(balance {balance}: stage {stage} needs {human_bytes(peak)}), and each rank has "
                f"{human_bytes(m.capacity)}{where}. {self._change(batch_key)}")

    def _change(self, batch_key: str) -> str:
        """What to change: what lowers activations, unless no cut's weights alone fit."""
        m = self.memory
        layers = range(len(m.figures.layers))
        each = [m.figures.params([range(i, i + 1)]) for i in layers]
        lightest = partition.balance_by_cost(each, m.stages)  # the cut with the least weights on its fullest stage
        starts = [sum(lightest[:s]) for s in range(m.stages)]
        weights = max(m.figures.params([range(a, a + n)]) for a, n in zip(starts, lightest)) * m.bytes_per_param
        if self.virtual > 1 or weights <= m.capacity:
            return lower_activations(batch_key, m.checkpoint)
        total = m.figures.params([layers]) * m.bytes_per_param
        return weights_over(f"{human_bytes(weights)} on some stage of any cut", total, m.capacity, m.shared,
                            max(each) * m.bytes_per_param > m.capacity)


def lower_activations(batch_key: str, checkpoint: str) -> str:
    """The advice for a stage whose activations are over its memory: what lowers them."""
    change = "raise pipeline.microbatches or pipeline.partitions"
    change += "" if checkpoint == "always" else ", or set pipeline.checkpoint: always"
    return f"Lower {batch_key}, {change}"


def weights_over(need: str, total: float, capacity: float, shared: bool, one_layer: bool = False) -> str:
    """What can help when a stage's weights, gradients and optimizer state alone (`need`) are over its memory
    (`one_layer`: a single layer's are)."""
    # A batch, micro-batches or remat change only activations; more ranks sharing one RAM each get less, and no
    # cut splits a layer.
    said = f"Weights, gradients and optimizer state alone need {need}"
    if shared or one_layer:
        return f"{said} (all stages' {human_bytes(total)}): choose a smaller model or a larger machine"
    return (f"{said}: raise pipeline.partitions (all stages' {human_bytes(total)} is "
            f"{math.ceil(total / capacity)} ranks' worth)")


def worth_checking(costs: Sequence[float], balance: Sequence[int], microbatches: int) -> bool:
    """Whether a step's slowest stage, as predicted, computes long enough to be worth trial steps."""
    return max(partition.stage_costs(costs, balance)) * microbatches >= MIN_STEP_SECONDS


def stage_compute(pipe: Pipeline, batch: Batch | None, microbatches: int, seed: int,
                  steps: int = TRIAL_STEPS) -> list[float] | None:
    """Each stage's median compute seconds over trial steps of `batch` (rank 0, else None); rebuild layers after."""
    # `batch`: this rank's shard of a real training mini-batch (None where the stage takes no data), so the
    # trial steps compute and hold what a step of the run does, token budget included.
    layout, device = pipe.layout, pipe.device
    inputs = batch.inputs if batch is not None and layout.is_first else None
    targets = batch.targets if batch is not None and layout.is_last else None
    offset = batch.offset if batch is not None else 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # the same dropout in every trial step of every cut timed
        rows: list[list[float]] = []
        for step in range(steps):
            result = pipe.train_step(inputs, targets, step=step, microbatches=microbatches, example_offset=offset,
                                     measure_memory=False)
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
