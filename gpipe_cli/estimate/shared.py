"""Run the action lists on ranks that share one machine's cores: an action runs faster while fewer ranks compute.

Per-layer seconds timed while every rank computes are what an action costs in a pipeline's steady state;
in its fill and drain, and whenever a neighbour waits, the ranks still computing have the cores, caches
and memory to fewer and run faster. `rate(busy)` says how much faster: the work an action has left,
counted in all-busy seconds, drains at that rate while `busy` ranks compute. With a rate of 1 throughout
this is `schedule.simulate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpipe_cli.pipeline.schedule import COMPUTE, Action, ActionList, Cost, Kind, Span, peer

Rate = Callable[[int], float]
_RECV = (Kind.RECV_FWD, Kind.RECV_BWD)
_SEND = (Kind.SEND_FWD, Kind.SEND_BWD)


def rate_model(alone_speedup: float, stages: int, replicas: int = 1) -> Rate:
    """Speed with `busy` of a pipeline's stages computing, its replicas in step: `alone_speedup` for one rank
    of all computing, 1 for all of them, linear in the share of ranks idle in between."""
    ranks = stages * replicas

    def rate(busy: int) -> float:
        if ranks <= 1:
            return 1.0
        idle_share = (ranks - busy * replicas) / (ranks - 1)
        return 1.0 + (alone_speedup - 1.0) * max(idle_share, 0.0)
    return rate


def simulate(schedules: Sequence[ActionList], cost: Cost, latency: Cost, rate: Rate,
             placement: str = "loop") -> list[list[Span]]:
    """The spans of every action, compute draining at `rate(busy)`; a receive waits for its message."""
    run = _Run(schedules, cost, latency, placement)
    while True:
        while any([run.advance(s) for s in range(len(schedules))]):  # a message sent now may be received now
            pass
        if not run.running and run.done():
            return run.spans
        run.step(rate(len(run.running)) if run.running else 1.0)


class _Run:
    """The state of a simulation: where each stage is, what it computes, which messages are on their way."""

    def __init__(self, schedules: Sequence[ActionList], cost: Cost, latency: Cost, placement: str = "loop") -> None:
        self.schedules, self.cost, self.latency, self.placement = schedules, cost, latency, placement
        self.arrival: dict[tuple[int, Kind, int, int], float] = {}
        self.spans: list[list[Span]] = [[] for _ in schedules]
        self.cursor, self.since = [0] * len(schedules), [0.0] * len(schedules)
        self.running: dict[int, tuple[float, float]] = {}  # stage -> (start, work left in all-busy seconds)
        self.now = 0.0

    def done(self) -> bool:
        """Whether every stage has run its whole list."""
        return all(c == len(s) for c, s in zip(self.cursor, self.schedules))

    def _next(self, stage: int) -> Action | None:
        at = self.cursor[stage]
        return self.schedules[stage][at] if at < len(self.schedules[stage]) else None

    def _finish(self, stage: int, start: float, end: float) -> None:
        action = self.schedules[stage][self.cursor[stage]]
        self.spans[stage].append(Span(stage, action, start, end))
        self.since[stage] = end
        self.cursor[stage] += 1

    def advance(self, stage: int) -> bool:
        """Take `stage` through its messages up to its next compute (started) or a message not yet here."""
        moved = False
        while stage not in self.running and (action := self._next(stage)) is not None:
            if action.kind in _RECV:
                at = self.arrival.get(_key(action, stage))
                if at is None or at > self.now:
                    break
                self._finish(stage, self.since[stage], self.now)
            elif action.kind in _SEND:
                other, chunk = peer(action, len(self.schedules), self.placement)
                recv = Kind.RECV_FWD if action.kind == Kind.SEND_FWD else Kind.RECV_BWD
                self.arrival[(other, recv, chunk, action.microbatch)] = self.now + self.latency(stage, action)
                self._finish(stage, self.now, self.now)
            elif action.kind in COMPUTE:
                self.running[stage] = (self.now, self.cost(stage, action))
            else:
                self._finish(stage, self.now, self.now)
            moved = True
        return moved

    def step(self, speed: float) -> None:
        """Move time to the next compute end or awaited arrival, draining the running compute at `speed`."""
        ends = {s: self.now + left / speed for s, (_, left) in self.running.items()}
        waits = [at for s in range(len(self.schedules)) if s not in self.running
                 for action in [self._next(s)] if action is not None and action.kind in _RECV
                 for at in [self.arrival.get(_key(action, s), -1.0)] if at > self.now]
        if not ends and not waits:
            stuck = {s: str(a) for s in range(len(self.schedules)) if (a := self._next(s)) is not None}
            raise RuntimeError(f"schedule deadlocks: stages wait at {stuck}")
        later = min([*ends.values(), *waits])
        for s, (start, left) in list(self.running.items()):
            if ends[s] <= later:
                del self.running[s]
                self._finish(s, start, later)
            else:
                self.running[s] = (start, left - (later - self.now) * speed)
        self.now = later


def _key(action: Action, stage: int) -> tuple[int, Kind, int, int]:
    """The arrival a receive waits for."""
    return stage, action.kind, action.chunk, action.microbatch
