"""V-shaped schedules (Qi et al., 2024): two chunks per stage, down the stages and back up.

Chunk c runs on stage c for c < K and on stage 2K-1-c after, so the first and last chunks share
stage 0 and the two chunks at the turn share stage K-1 (they hand over in memory). K=3 (chunks 0..5):

    stage 0   0 ............ 5       the inputs go in and the loss comes out on stage 0
    stage 1     1 ........ 4
    stage 2       2 .. 3

Each stage's order comes from running all stages on ideal devices (a forward, an input-gradient B
and a weight-gradient W one unit each; chunk 0's backward stays whole): a free stage runs a ready
B, then a ready forward (the upper chunk first), then a pending W, which fills what would be idle;
or forwards before Bs. A chunk's activations are held from its forward to its W (or whole backward),
and no stage ever holds more than a cap of them, counted in chunks. Two rules admit a micro-batch on
a stage's lower chunk, both sure to run to the end for any cap of at least 2:

    reserve   held + one slot kept for each started micro-batch's upper chunk + 2 within the cap
    drain n   a free slot, and at most n < cap micro-batches between their lower and upper chunk
              here; an upper chunk then waits for a slot. A micro-batch past its upper chunk here
              needs only backwards and upper chunks nearer stage 0 to free its slots, so stage 0
              drains first, then stage 1, and so on, until each stage holds at most n: room.

Of the runs (each rule, each n, Bs first or forwards first) the shortest gives the orders.

    zero-bubble-v  cap 2K: 1F1B's peak (K micro-batches of a whole stage), B and W apart (ZB-V)
    v-half         cap K: half of 1F1B's peak, at some bubble (V-Half)
"""

from __future__ import annotations

import functools
from abc import abstractmethod

from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.schedules.base import Schedule

_COST = {Kind.FWD: 1, Kind.BWD_INPUT: 1, Kind.BWD_WEIGHT: 1, Kind.BWD: 2}


@functools.lru_cache(maxsize=64)
def orders(stages: int, microbatches: int, cap: int) -> tuple[tuple[Step, ...], ...]:
    """Every stage's order under a cap of `cap` held chunk activations (at least 2): of the greedy runs under
    each rule, with Bs first and with forwards first, the one that ends soonest (the first of equals)."""
    runs = [_greedy(stages, microbatches, cap, forwards_first, between)
            for between in (None, *range(1, cap)) for forwards_first in (False, True)]
    return min((run for run in runs if run is not None), key=lambda run: run[0])[1]


def _greedy(stages: int, microbatches: int, cap: int, forwards_first: bool,
            between: int | None) -> tuple[int, tuple[tuple[Step, ...], ...]] | None:
    """The greedy run's length on ideal devices and every stage's order, under the reserve rule (`between`
    None) or the drain rule with n = `between`; None if it gets stuck (which the rules above exclude)."""
    k, m, last = stages, microbatches, 2 * stages - 1
    finished: dict[tuple[Kind, int, int], int] = {}  # (F or B, micro-batch, chunk) -> when it ended
    next_fwd, next_bwd = [0] * (last + 1), [0] * (last + 1)
    pending: list[list[tuple[int, int]]] = [[] for _ in range(k)]  # (micro-batch, chunk) with B done, W not
    held, kept, free_at = [0] * k, [0] * k, [0] * k
    out: list[list[Step]] = [[] for _ in range(k)]
    left, now = 6 * m * k - m, 0  # F, B and W of each of 2K chunks; chunk 0 has no W

    def ended(kind: Kind, mb: int, chunk: int) -> bool:
        return finished.get((kind, mb, chunk), now + 1) <= now

    def backward(chunk: int) -> Step | None:
        mb = next_bwd[chunk]
        if mb < m and ended(Kind.FWD, mb, chunk) and (chunk == last or ended(Kind.BWD, mb, chunk + 1)):
            return (Kind.BWD if chunk == 0 else Kind.BWD_INPUT, mb, chunk)
        return None

    def forward(chunk: int) -> Step | None:
        mb = next_fwd[chunk]
        if mb < m and (chunk == 0 or ended(Kind.FWD, mb, chunk - 1)):
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
            finished[(Kind.BWD if kind == Kind.BWD_INPUT else kind, mb, chunk)] = free_at[s]
            out[s].append(step)
            left -= 1
        if left and max(free_at) <= now:  # nothing runs and nothing started: no later tick differs
            return None
        now += 1
    return max(free_at), tuple(tuple(o) for o in out)


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

