"""V-shaped schedules (Qi et al., 2024): two chunks per stage, down the stages and back up."""

from __future__ import annotations

import functools
import heapq
from abc import abstractmethod

from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.placement import owner
from gpipe_cli.pipeline.schedules.base import Schedule

_TICKS = 2  # ticks per unit of work: a message's delay is a tick, half a forward
_COST = {Kind.FWD: _TICKS, Kind.BWD_INPUT: _TICKS, Kind.BWD_WEIGHT: _TICKS, Kind.BWD: 2 * _TICKS}
_DELAY = 1  # ticks a message takes between stages in the runs made with a delay

Orders = tuple[tuple[Step, ...], ...]


@functools.lru_cache(maxsize=64)
def orders(stages: int, microbatches: int, cap: int) -> Orders:
    """Every stage's order under a cap of `cap` (at least 2) held chunk activations: the best of the greedy runs."""
    # The shortest with messages free, then with them delayed: a run made with the delay sends earlier and waits
    # later at the same length (the first of equals wins).
    runs = [run for delay in (0, _DELAY) for between in (None, *range(1, cap)) for forwards_first in (False, True)
            if (run := _greedy(stages, microbatches, cap, forwards_first, between, delay)) is not None]
    lengths = [_replay(run, stages, 0) for run in runs]
    shortest = [run for run, length in zip(runs, lengths) if length == min(lengths)]  # the theory's bubble
    return min(shortest, key=lambda run: _replay(run, stages, _DELAY))


def _needs(step: Step, stages: int) -> list[tuple[Kind, int, int]]:
    """What a step waits for: the (F or B, micro-batch, chunk) before it in the V."""
    kind, mb, chunk = step
    if kind == Kind.FWD:
        return [(Kind.FWD, mb, chunk - 1)] if chunk else []
    if kind == Kind.BWD_WEIGHT:
        return [(Kind.BWD, mb, chunk)]
    return [(Kind.FWD, mb, chunk)] + ([(Kind.BWD, mb, chunk + 1)] if chunk < 2 * stages - 1 else [])


def _replay(run: Orders, stages: int, delay: int) -> int:
    """When the orders end on ideal devices, each step as soon as its stage is free and what it needs has ended."""
    ended: dict[tuple[Kind, int, int], int] = {}
    at, free = [0] * stages, [0] * stages
    moved = True
    while moved:
        moved = False
        for s, order in enumerate(run):
            while at[s] < len(order):
                kind, mb, chunk = order[at[s]]
                needs = _needs(order[at[s]], stages)
                if any(need not in ended for need in needs):
                    break
                start = max([free[s], *(ended[need] + (delay if owner(need[2], stages, "v") != s else 0)
                                        for need in needs)])
                free[s] = start + _COST[kind]
                ended[(Kind.BWD if kind == Kind.BWD_INPUT else kind, mb, chunk)] = free[s]
                at[s] += 1
                moved = True
    return max(free)


# A step on one stage sees one on another `delay` ticks after it ended. Both rules finish for any cap of at least 2.
def _greedy(stages: int, microbatches: int, cap: int, forwards_first: bool,
            between: int | None, delay: int = 0) -> Orders | None:
    """Every stage's order in the greedy run on ideal devices under the reserve or drain-`between` rule, or None."""
    k, m, last = stages, microbatches, 2 * stages - 1
    finished: dict[tuple[Kind, int, int], int] = {}  # (F or B, micro-batch, chunk) -> when it ended
    next_fwd, next_bwd = [0] * (last + 1), [0] * (last + 1)
    pending: list[list[tuple[int, int]]] = [[] for _ in range(k)]  # (micro-batch, chunk) with B done, W not
    held, kept, free_at = [0] * k, [0] * k, [0] * k
    out: list[list[Step]] = [[] for _ in range(k)]
    left, now = 6 * m * k - m, 0  # F, B and W of each of 2K chunks; chunk 0 has no W
    owners = [owner(chunk, k, "v") for chunk in range(last + 1)]
    events: list[int] = []  # ticks when a step ends or its result reaches the other stages

    def ended(kind: Kind, mb: int, chunk: int, reader: int) -> bool:
        return finished.get((kind, mb, chunk), now + 1) + (delay if owners[chunk] != owners[reader] else 0) <= now

    def backward(chunk: int) -> Step | None:
        mb = next_bwd[chunk]
        if mb < m and ended(Kind.FWD, mb, chunk, chunk) and (chunk == last or ended(Kind.BWD, mb, chunk + 1, chunk)):
            return (Kind.BWD if chunk == 0 else Kind.BWD_INPUT, mb, chunk)
        return None

    def forward(chunk: int) -> Step | None:
        mb = next_fwd[chunk]
        if mb < m and (chunk == 0 or ended(Kind.FWD, mb, chunk - 1, chunk)):
            return (Kind.FWD, mb, chunk)
        return None

    while left:
        for s in range(k):
            if free_at[s] > now:
                continue
            down, up = s, last - s
            slot = between is None or held[s] < cap
            room = held[s] + kept[s] + 2 <= cap if between is None else slot and kept[s] < between
            upper = forward(up) if slot else None
            if forwards_first:
                step = upper or (forward(down) if room else None) or backward(up) or backward(down)
            else:
                step = backward(up) or backward(down) or upper or (forward(down) if room else None)
            if step is None and pending[s]:
                step = (Kind.BWD_WEIGHT, *pending[s].pop(0))
            if step is None:
                continue
            kind, mb, chunk = step
            if kind == Kind.FWD:
                next_fwd[chunk] += 1
                held[s] += 1
                kept[s] += 1 if chunk == down else -1
            elif kind in (Kind.BWD, Kind.BWD_INPUT):
                next_bwd[chunk] += 1
                if kind == Kind.BWD_INPUT:
                    pending[s].append((mb, chunk))
            if kind in (Kind.BWD, Kind.BWD_WEIGHT):
                held[s] -= 1
            free_at[s] = now + _COST[kind]
            heapq.heappush(events, free_at[s])
            heapq.heappush(events, free_at[s] + delay)
            finished[(Kind.BWD if kind == Kind.BWD_INPUT else kind, mb, chunk)] = free_at[s]
            out[s].append(step)
            left -= 1
        while events and events[0] <= now:
            heapq.heappop(events)
        if left and not events:  # nothing runs, nothing on its way: no later tick differs
            return None
        now = events[0] if events else now  # the next tick where a step ends or its result arrives
    return tuple(tuple(o) for o in out)


class _VShape(Schedule):
    """Two chunks per stage in a V; orders from a greedy run on ideal devices under an activation cap."""

    chunked = True
    placement = "v"

    @abstractmethod
    def cap(self, stages: int) -> int:
        """How many chunk activations a stage may hold."""

    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """The greedy run's order for `stage`."""
        return list(orders(stages, microbatches, self.cap(stages))[stage])

    def check(self, stages: int, microbatches: int, virtual: int) -> None:
        """A V is exactly two chunks per stage."""
        if virtual != 2:
            raise ValueError(f"schedule '{self.name}' runs 2 chunks per stage: virtual_stages must be 2 "
                             f"(got {virtual})")


class ZeroBubbleV(_VShape):
    """ZB-V: 1F1B's activation peak, B and W split so the Ws fill the bubble."""

    name = "zero-bubble-v"
    torch_counterpart = "ScheduleZBVZeroBubble"

    def cap(self, stages: int) -> int:
        """2K chunks: K micro-batches of a whole stage, as 1F1B's first stage."""
        return 2 * stages


class VHalf(_VShape):
    """V-Half: half of 1F1B's activations."""

    name = "v-half"

    def cap(self, stages: int) -> int:
        """K chunks, half of 1F1B's 2K; 2 on one stage, where a micro-batch's two chunks meet."""
        return max(stages, 2)

