"""V-shaped schedules (Qi et al., 2024): two chunks per stage, down the stages and back up."""

from __future__ import annotations

import collections
import functools
from abc import abstractmethod

from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.placement import owner
from gpipe_cli.pipeline.schedules.base import Schedule

_TICKS = 2  # ticks per unit of work: a message's delay is a tick, half a forward
_COST = {Kind.FWD: _TICKS, Kind.BWD_INPUT: _TICKS, Kind.BWD_WEIGHT: _TICKS, Kind.BWD: 2 * _TICKS}
_DELAY = 1  # ticks a message takes between stages in the runs made with a delay

Orders = tuple[tuple[Step, ...], ...]
Run = list[tuple[int, Step]]  # (stage, step) in the order the steps started: what each needs comes before it
_NEVER = 1 << 62  # when a step that has not run ended


@functools.lru_cache(maxsize=64)
def orders(stages: int, microbatches: int, cap: int) -> Orders:
    """Every stage's order under a cap of `cap` (at least 2) held chunk activations: the best of the greedy runs."""
    # The shortest with messages free, then with them delayed: a run made with the delay sends earlier and waits
    # later at the same length (the first of equals wins).
    runs = [run for delay in (0, _DELAY) for between in (None, *range(1, cap)) for forwards_first in (False, True)
            if (run := _greedy(stages, microbatches, cap, forwards_first, between, delay)) is not None]
    lengths = [_replay(run, stages, microbatches, 0) for run in runs]
    shortest = [run for run, length in zip(runs, lengths) if length == min(lengths)]  # the theory's bubble
    best = min(shortest, key=lambda run: _replay(run, stages, microbatches, _DELAY))
    return tuple(tuple(step for s, step in best if s == stage) for stage in range(stages))


def _sees(stages: int, delay: int) -> tuple[list[int], list[int]]:
    """The delay until each chunk sees the forward before it and the backward after it (0 on its own stage)."""
    owners = [owner(chunk, stages, "v") for chunk in range(2 * stages)]
    return ([delay if c > 0 and owners[c - 1] != owners[c] else 0 for c in range(2 * stages)],
            [delay if c < 2 * stages - 1 and owners[c + 1] != owners[c] else 0 for c in range(2 * stages)])


def _replay(run: Run, stages: int, microbatches: int, delay: int) -> int:
    """When the run ends on ideal devices, each step as soon as its stage is free and what it needs has ended."""
    # Rows of when each chunk's steps ended, per micro-batch: forwards shifted by one, row 0 the input, and the
    # backwards' row 2K the loss, both there from the start.
    fwd, bwd = ([[0] * microbatches for _ in range(2 * stages + 1)] for _ in range(2))
    free, (sees_fwd, sees_bwd) = [0] * stages, _sees(stages, delay)
    for s, (kind, mb, chunk) in run:
        if kind == Kind.FWD:
            free[s] = fwd[chunk + 1][mb] = max(free[s], fwd[chunk][mb] + sees_fwd[chunk]) + _COST[kind]
        elif kind == Kind.BWD_WEIGHT:
            free[s] = max(free[s], bwd[chunk][mb]) + _COST[kind]
        else:
            free[s] = bwd[chunk][mb] = max(free[s], fwd[chunk + 1][mb], bwd[chunk + 1][mb] + sees_bwd[chunk]) + \
                _COST[kind]
    return max(free)


# A step on one stage sees one on another `delay` ticks after it ended. Both rules finish for any cap of at least 2.
def _greedy(stages: int, microbatches: int, cap: int, forwards_first: bool,
            between: int | None, delay: int = 0) -> Run | None:
    """The steps of the greedy run on ideal devices under the reserve or drain-`between` rule, or None."""
    k, m, last = stages, microbatches, 2 * stages - 1
    # When each chunk's steps ended, as in `_replay`, but not yet run: never.
    fwd = [[0] * m] + [[_NEVER] * m for _ in range(2 * k)]
    bwd = [[_NEVER] * m for _ in range(2 * k)] + [[0] * m]
    sees_fwd, sees_bwd = _sees(k, delay)
    next_fwd, next_bwd = [0] * (last + 1), [0] * (last + 1)
    pending: list[collections.deque[tuple[int, int]]] = [collections.deque() for _ in range(k)]  # B done, W not
    held, kept, free_at = [0] * k, [0] * k, [0] * k
    out: Run = []
    left, now = 6 * m * k - m, 0  # F, B and W of each of 2K chunks; chunk 0 has no W
    # A stage that found nothing to start finds nothing until a step of its own or a neighbour's ends (or its result
    # reaches it): only those ticks, and those stages, are looked at.
    woken: collections.defaultdict[int, set[int]] = collections.defaultdict(set, {0: set(range(k))})
    near = [{t for t in (s - 1, s, s + 1) if 0 <= t < k} for s in range(k)]

    def forward(chunk: int) -> bool:
        mb = next_fwd[chunk]
        return mb < m and fwd[chunk][mb] + sees_fwd[chunk] <= now

    def backward(chunk: int) -> bool:
        mb = next_bwd[chunk]
        return mb < m and fwd[chunk + 1][mb] <= now and bwd[chunk + 1][mb] + sees_bwd[chunk] <= now

    while left:
        if not woken:  # nothing runs, nothing on its way: no later tick differs
            return None
        now = min(woken)
        for s in woken.pop(now):
            if free_at[s] > now:
                continue
            down, up = s, last - s
            slot = between is None or held[s] < cap
            room = held[s] + kept[s] + 2 <= cap if between is None else slot and kept[s] < between
            forwards = up if slot and forward(up) else down if room and forward(down) else None
            backwards = up if backward(up) else down if backward(down) else None
            back = backwards is not None and (forwards is None or not forwards_first)
            chunk = backwards if back else forwards
            if chunk is None and not pending[s]:
                continue
            if chunk is None:
                kind, (mb, chunk) = Kind.BWD_WEIGHT, pending[s].popleft()
                held[s] -= 1
                end = now + _TICKS
            elif back:
                kind, mb = Kind.BWD if chunk == 0 else Kind.BWD_INPUT, next_bwd[chunk]
                next_bwd[chunk] += 1
                if chunk:
                    pending[s].append((mb, chunk))
                else:
                    held[s] -= 1
                end = bwd[chunk][mb] = now + (_TICKS if chunk else 2 * _TICKS)
            else:
                kind, mb = Kind.FWD, next_fwd[chunk]
                next_fwd[chunk] += 1
                held[s] += 1
                kept[s] += 1 if chunk == down else -1
                end = fwd[chunk + 1][mb] = now + _TICKS
            free_at[s] = end
            woken[end].add(s)
            woken[end + delay] |= near[s]
            out.append((s, (kind, mb, chunk)))
            left -= 1
    return out


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

