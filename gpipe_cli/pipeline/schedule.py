"""Pipeline schedules as data: one list of actions per stage, built once, read by everything."""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpipe_cli.pipeline import placement as placement_
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.actions import COMPUTE, GRADIENT, RELEASE, Action, Kind, Step
from gpipe_cli.pipeline.config import REMAT_MODES, PipelineConfig, microbatch_problem
from gpipe_cli.pipeline.placement import owner

__all__ = ["COMPUTE", "GRADIENT", "RELEASE", "REMAT_MODES", "SCHEDULES", "Action", "Kind", "ActionList", "Span",
           "Step", "bubble", "build", "build_all", "check", "forward_only", "owner", "peer",
           "remat_pairs", "rematerialised", "render", "seconds", "simulate", "theoretical_bubble"]


ActionList = list[Action]
SCHEDULES = schedules.names()


def check(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Refuse, with one line, a schedule that cannot run K stages x V chunks with M micro-batches."""
    PipelineConfig(stages, microbatches, virtual=virtual, schedule=name)


def _check(stage: int, stages: int, microbatches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) (got {stage})")
    if problem := microbatch_problem(microbatches):
        raise ValueError(problem)


def remat_pairs(mode: str, order: Sequence[Step]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs a stage rematerialises under a mode, given its order of work."""
    mbs = {(mb, chunk) for kind, mb, chunk in order if kind == Kind.FWD}
    if mode == "always":
        return mbs
    if mode == "never":
        return set()
    if mode == "except_last":
        immediate = {order[i][1:] for i in range(len(order) - 1)
                     if order[i][0] == Kind.FWD and order[i + 1][0] in GRADIENT and order[i + 1][1:] == order[i][1:]}
        return mbs - immediate
    raise ValueError(f"unknown checkpoint mode '{mode}': allowed are {', '.join(REMAT_MODES)}")


# `local`: the chunks of this stage. A neighbouring chunk on this same stage hands over in memory: no message.
def _forward(chunk: int, chunks: int, mb: int, remat: bool, local: Collection[int]) -> list[Action]:
    first, last = chunk == 0, chunk == chunks - 1
    return ([] if first or chunk - 1 in local else [Action(Kind.RECV_FWD, mb, chunk)]) + \
        [Action(Kind.FWD, mb, chunk, remat)] + \
        ([] if last or chunk + 1 in local else [Action(Kind.SEND_FWD, mb, chunk)])


def _gradient(chunk: int, chunks: int, kind: Kind, mb: int, remat: bool, local: Collection[int]) -> list[Action]:
    first, last = chunk == 0, chunk == chunks - 1
    # Recompute before waiting for the gradient, so the rematerialisation hides the wait.
    return ([Action(Kind.RECOMPUTE, mb, chunk)] if remat else []) + \
        ([] if last or chunk + 1 in local else [Action(Kind.RECV_BWD, mb, chunk)]) + [Action(kind, mb, chunk)] + \
        ([] if first or chunk - 1 in local else [Action(Kind.SEND_BWD, mb, chunk)])


def build(name: str, stage: int, stages: int, microbatches: int, checkpoint: str = "except_last",
          virtual: int = 1) -> ActionList:
    """The action list of one stage (of V chunks) for a training step; rematerialisation is decided here, once."""
    return list(_built(name, stage, stages, microbatches, checkpoint, virtual))


# The planner and the memory walk ask for the same lists hundreds of times; building V-shapes greedily is slow.
@functools.lru_cache(maxsize=4096)
def _built(name: str, stage: int, stages: int, microbatches: int, checkpoint: str,
           virtual: int) -> tuple[Action, ...]:
    _check(stage, stages, microbatches)
    check(name, stages, microbatches, virtual)
    order = schedules.get(name).order(stage, stages, microbatches, virtual)
    remat = remat_pairs(checkpoint, order)
    chunks, local = stages * virtual, placement_.chunks_of(stage, stages, virtual, schedules.get(name).placement)
    actions: ActionList = []
    for kind, mb, chunk in order:
        if kind == Kind.FWD:
            actions += _forward(chunk, chunks, mb, (mb, chunk) in remat, local)
        elif kind in GRADIENT:
            actions += _gradient(chunk, chunks, kind, mb, (mb, chunk) in remat, local)
        else:
            actions.append(Action(kind, mb, chunk))
    return tuple(actions)


def forward_only(stage: int, stages: int, microbatches: int, virtual: int = 1,
                 placement: str = "loop") -> ActionList:
    """The action list of one stage for an evaluation (no-grad) pass: each chunk in turn, any M."""
    _check(stage, stages, microbatches)
    local = placement_.chunks_of(stage, stages, virtual, placement)
    return [a for chunk in local for mb in range(microbatches)
            for a in _forward(chunk, stages * virtual, mb, False, local)]


def build_all(name: str, stages: int, microbatches: int, checkpoint: str = "except_last",
              virtual: int = 1) -> list[ActionList]:
    """The action lists of every stage."""
    return [build(name, s, stages, microbatches, checkpoint, virtual) for s in range(stages)]


def rematerialised(schedule: ActionList) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs whose forward keeps no graph, as the list marks them."""
    return {(a.microbatch, a.chunk) for a in schedule if a.kind == Kind.FWD and a.remat}


def restores(schedule: ActionList) -> list[Action]:
    """The actions that first need what a micro-batch stored, in order: each recompute, a kept one's first backward."""
    remat = rematerialised(schedule)
    return [a for a in schedule if a.kind == Kind.RECOMPUTE
            or (a.kind in GRADIENT and (a.microbatch, a.chunk) not in remat)]


def peer(action: Action, stages: int, placement: str = "loop") -> tuple[int, int]:
    """The stage and chunk at the other end of a message action."""
    chunk = action.chunk + (1 if action.kind in (Kind.SEND_FWD, Kind.RECV_BWD) else -1)
    return owner(chunk, stages, placement), chunk


def render(lists: Sequence[ActionList]) -> str:
    """The action lists as text, one line per stage (with each action's chunk when a stage runs several)."""
    lines = []
    for s, acts in enumerate(lists):
        several = len({a.chunk for a in acts}) > 1
        lines.append(f"stage {s}: " + " ".join(f"{a}/c{a.chunk}" if several else str(a) for a in acts))
    return "\n".join(lines)


_UNIT = {Kind.FWD: 1.0, Kind.RECOMPUTE: 1.0, Kind.BWD: 2.0, Kind.BWD_INPUT: 1.0, Kind.BWD_WEIGHT: 1.0}


@functools.lru_cache(maxsize=256)
def theoretical_bubble(stages: int, microbatches: int, name: str = "gpipe", virtual: int = 1) -> float:
    """A schedule's idle fraction for equal stage costs (backward = 2 forwards), free messages, no remat."""
    closed = schedules.get(name).bubble(stages, microbatches, virtual)
    if closed is not None:
        return closed
    plans = build_all(name, stages, microbatches, "never", virtual)
    return bubble(simulate(plans, lambda stage, action: _UNIT.get(action.kind, 0.0) / virtual,
                           placement=schedules.get(name).placement))


@dataclass(frozen=True)
class Span:
    """When one action ran in a simulation or a measurement, in seconds from the step start."""

    stage: int
    action: Action
    start: float
    end: float

    def record(self) -> dict[str, Any]:
        """As the plain data a trace reads: the action's kind by name."""
        return {"stage": self.stage, "kind": self.action.kind.value, "microbatch": self.action.microbatch,
                "start": self.start, "end": self.end, "chunk": self.action.chunk}


def seconds(spans: Iterable[Span], kinds: Collection[Kind] = COMPUTE) -> float:
    """How long the spans of actions of `kinds` last, together (compute actions unless told)."""
    return sum(sp.end - sp.start for sp in spans if sp.action.kind in kinds)


Cost = Callable[[int, Action], float]
Rate = Callable[[int], float]
_RECV = (Kind.RECV_FWD, Kind.RECV_BWD)
_SEND = (Kind.SEND_FWD, Kind.SEND_BWD)


# A send does not block. `rate(busy)` says how much faster compute drains while only `busy` stages compute (ranks
# sharing a machine's cores): a cost counts all-busy seconds.
def simulate(lists: Sequence[ActionList], cost: Cost, latency: Cost | None = None,
             placement: str = "loop", rate: Rate | None = None) -> list[list[Span]]:
    """Every stage's spans when the lists run on ideal devices, compute taking `cost` and messages `latency`."""
    run = _Run(lists, cost, latency or (lambda stage, action: 0.0), placement)
    movable = list(range(len(lists)))
    while True:
        run.settle(movable)
        if not run.running and run.done():
            return run.spans
        movable = run.step(rate(len(run.running)) if rate is not None and run.running else 1.0)


class _Run:
    """The state of a simulation: where each stage is, what it computes, which messages are on their way."""

    def __init__(self, lists: Sequence[ActionList], cost: Cost, latency: Cost, placement: str) -> None:
        self.lists, self.cost, self.latency, self.placement = lists, cost, latency, placement
        self.arrival: dict[tuple[int, Kind, int, int], float] = {}
        self.spans: list[list[Span]] = [[] for _ in lists]
        self.cursor, self.since = [0] * len(lists), [0.0] * len(lists)
        self.running: dict[int, float] = {}  # stage -> work left in all-busy seconds (it started at `since`)
        self.waiting: dict[int, tuple[int, Kind, int, int]] = {}  # stage -> the arrival its next receive waits for
        self.now = 0.0

    def done(self) -> bool:
        """Whether every stage has run its whole list."""
        return all(c == len(s) for c, s in zip(self.cursor, self.lists))

    def _next(self, stage: int) -> Action | None:
        at = self.cursor[stage]
        return self.lists[stage][at] if at < len(self.lists[stage]) else None

    def _finish(self, stage: int, start: float, end: float) -> None:
        self.spans[stage].append(Span(stage, self.lists[stage][self.cursor[stage]], start, end))
        self.since[stage] = end
        self.cursor[stage] += 1

    # As polling every stage in turn until none moves, in the same order (the costs are asked for in it): a message
    # sent now lets a later stage move in this round, an earlier one in the next.
    def settle(self, stages: list[int]) -> None:
        """Advance `stages` (all that may move now) in rounds of ascending stage order until none moves."""
        turns = [(0, stage) for stage in sorted(stages)]
        while turns:
            turn, stage = heapq.heappop(turns)
            for other in self.advance(stage):
                heapq.heappush(turns, (turn + (other <= stage), other))

    def advance(self, stage: int) -> list[int]:
        """Take `stage` up to its next compute (started) or a message not yet here: whom its messages reach now."""
        reached, now, actions, cursor = [], self.now, self.lists[stage], self.cursor
        while stage not in self.running and cursor[stage] < len(actions):
            action = actions[cursor[stage]]
            if action.kind in _RECV:
                key = (stage, action.kind, action.chunk, action.microbatch)
                at = self.arrival.get(key)
                if at is None or at > now:
                    self.waiting[stage] = key
                    break
                self.waiting.pop(stage, None)
                self._finish(stage, self.since[stage], now)
            elif action.kind in _SEND:
                other, chunk = peer(action, len(self.lists), self.placement)
                recv = Kind.RECV_FWD if action.kind == Kind.SEND_FWD else Kind.RECV_BWD
                at = self.arrival[(other, recv, chunk, action.microbatch)] = now + self.latency(stage, action)
                if at <= now:
                    reached.append(other)
                self._finish(stage, now, now)
            elif action.kind in COMPUTE:
                self.running[stage] = self.cost(stage, action)
            else:
                self._finish(stage, now, now)
        return reached

    def step(self, speed: float) -> list[int]:
        """Move time to the next compute end or awaited arrival, draining compute at `speed`: who may move then."""
        now = self.now
        waits = {s: at for s, key in self.waiting.items() if (at := self.arrival.get(key, -1.0)) > now}
        if not self.running and not waits:
            stuck = {s: str(a) for s in range(len(self.lists)) if (a := self._next(s)) is not None}
            raise RuntimeError(f"schedule deadlocks: stages wait at {stuck}")
        ends = [now + left / speed for left in self.running.values()]
        later = min([*ends, *waits.values()])
        movable = [s for s, at in waits.items() if at <= later]
        ended = [s for s, end in zip(self.running, ends) if end <= later]
        for s in ended:
            del self.running[s]
            self._finish(s, self.since[s], later)
        drained = (later - now) * speed
        self.running = {s: left - drained for s, left in self.running.items()}
        self.now = later
        return movable + ended


def bubble(spans: Sequence[Sequence[Span]]) -> float:
    """Mean over stages of idle time / makespan, where busy time is compute actions only."""
    makespan = max(span.end for stage in spans for span in stage)
    if makespan <= 0:
        return 0.0
    idle = [1.0 - seconds(stage) / makespan for stage in spans]
    return sum(idle) / len(idle)
