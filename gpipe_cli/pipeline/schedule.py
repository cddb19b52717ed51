"""Pipeline schedules as data: a plain list of actions per stage.

GPipe fill-drain, K=3 stages, M=4 micro-batches (F forward, B backward, time flows right):

    stage 0  F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0
    stage 1  .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..
    stage 2  .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..

1F1B (PipeDream-flush) keeps at most K - stage micro-batches in flight:

    stage 0  F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1  .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2  .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Both give the same gradients. A schedule names receives and sends explicitly so it can be printed,
simulated and checked without processes; the runtime executes exactly these lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does."""

    RECV_FWD = "recv_fwd"    # wait for the input activation from the previous stage
    FWD = "fwd"              # forward (on the last stage, with the loss)
    SEND_FWD = "send_fwd"    # post the output activation to the next stage
    RECOMPUTE = "recompute"  # rematerialise the activations from the stored boundary input
    RECV_BWD = "recv_bwd"    # wait for the output gradient from the next stage
    BWD = "bwd"              # backward
    SEND_BWD = "send_bwd"    # post the input gradient to the previous stage


COMPUTE = frozenset({Kind.FWD, Kind.RECOMPUTE, Kind.BWD})
_SHORT = {Kind.RECV_FWD: "rf", Kind.FWD: "F", Kind.SEND_FWD: "sf", Kind.RECOMPUTE: "R",
          Kind.RECV_BWD: "rb", Kind.BWD: "B", Kind.SEND_BWD: "sb"}


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule, applied to one micro-batch."""

    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}"


Schedule = list[Action]
REMAT_MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b")


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    first, last = stage == 0, stage == stages - 1
    return ([] if first else [Action(Kind.RECV_FWD, mb)]) + [Action(Kind.FWD, mb)] + \
        ([] if last else [Action(Kind.SEND_FWD, mb)])


def _backward(stage: int, stages: int, mb: int, remat: bool) -> list[Action]:
    first, last = stage == 0, stage == stages - 1
    # Recompute before waiting for the gradient, so the rematerialisation hides the wait.
    return ([Action(Kind.RECOMPUTE, mb)] if remat else []) + \
        ([] if last else [Action(Kind.RECV_BWD, mb)]) + [Action(Kind.BWD, mb)] + \
        ([] if first else [Action(Kind.SEND_BWD, mb)])


def _check(stage: int, stages: int, microbatches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) (got {stage})")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (got {microbatches})")


def forward_order(name: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of forwards ('F') and backwards ('B') of one stage, before remat and messages."""
    _check(stage, stages, microbatches)
    if name == "gpipe":
        return [("F", i) for i in range(microbatches)] + \
            [("B", i) for i in reversed(range(microbatches))]
    if name == "1f1b":
        warmup = min(stages - stage - 1, microbatches)
        order = [("F", i) for i in range(warmup)]
        for j in range(microbatches - warmup):
            order += [("F", warmup + j), ("B", j)]
        order += [("B", j) for j in range(microbatches - warmup, microbatches)]
        return order
    raise ValueError(f"unknown schedule '{name}': allowed are {', '.join(SCHEDULES)}")


def remat_plan(mode: str, order: Sequence[tuple[str, int]]) -> set[int]:
    """The micro-batches a stage rematerialises under a mode.

    `except_last` skips the micro-batches whose backward directly follows their forward: keeping their
    activations costs nothing extra (GPipe: the last micro-batch; 1F1B: every one on the last stage).
    """
    mbs = {mb for op, mb in order if op == "F"}
    if mode == "always":
        return mbs
    if mode == "never":
        return set()
    if mode == "except_last":
        immediate = {order[i][1] for i in range(len(order) - 1)
                     if order[i][0] == "F" and order[i + 1] == ("B", order[i][1])}
        return mbs - immediate
    raise ValueError(f"unknown checkpoint mode '{mode}': allowed are {', '.join(REMAT_MODES)}")


def build(name: str, stage: int, stages: int, microbatches: int, checkpoint: str = "except_last") -> Schedule:
    """The action list of one stage for a training step."""
    order = forward_order(name, stage, stages, microbatches)
    remat = remat_plan(checkpoint, order)
    actions: Schedule = []
    for op, mb in order:
        actions += _forward(stage, stages, mb) if op == "F" else _backward(stage, stages, mb, mb in remat)
    return actions


def forward_only(stage: int, stages: int, microbatches: int) -> Schedule:
    """The action list of one stage for an evaluation (no-grad) pass."""
    _check(stage, stages, microbatches)
    return [a for mb in range(microbatches) for a in _forward(stage, stages, mb)]


def build_all(name: str, stages: int, microbatches: int, checkpoint: str = "except_last") -> list[Schedule]:
    """The action lists of every stage."""
    return [build(name, s, stages, microbatches, checkpoint) for s in range(stages)]


def message_order(schedule: Schedule, kind: Kind) -> list[int]:
    """The micro-batches of one kind of message, in the order the stage handles them."""
    return [a.microbatch for a in schedule if a.kind == kind]


def render(schedules: Sequence[Schedule]) -> str:
    """The action lists as text, one line per stage."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(schedules))


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (K-1)/(M+K-1) for equal stage costs."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass(frozen=True)
class Span:
    """When one action ran in a simulation or a measurement, in seconds from the step start."""

    stage: int
    action: Action
    start: float
    end: float


Cost = Callable[[int, Action], float]


def simulate(schedules: Sequence[Schedule], cost: Cost, latency: Cost | None = None) -> list[list[Span]]:
    """Run the action lists on ideal devices: compute takes `cost`, a message arrives `latency` after its send.

    Sends do not block (as in the runtime); a receive waits for the matching send. Returns the spans
    of every action of every stage.
    """
    latency = latency or (lambda stage, action: 0.0)
    stages = len(schedules)
    arrival: dict[tuple[int, Kind, int], float] = {}
    spans: list[list[Span]] = [[] for _ in range(stages)]
    cursor, clock = [0] * stages, [0.0] * stages
    remaining = sum(len(s) for s in schedules)
    while remaining:
        progressed = False
        for s in range(stages):
            while cursor[s] < len(schedules[s]):
                action = schedules[s][cursor[s]]
                start = clock[s]
                if action.kind in (Kind.RECV_FWD, Kind.RECV_BWD):
                    key = (s, action.kind, action.microbatch)
                    if key not in arrival:
                        break
                    end = max(start, arrival[key])
                elif action.kind in (Kind.SEND_FWD, Kind.SEND_BWD):
                    end = start
                    peer, recv = (s + 1, Kind.RECV_FWD) if action.kind == Kind.SEND_FWD else (s - 1, Kind.RECV_BWD)
                    arrival[(peer, recv, action.microbatch)] = end + latency(s, action)
                else:
                    end = start + cost(s, action)
                spans[s].append(Span(s, action, start, end))
                clock[s] = end
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(schedules[s][cursor[s]]) for s in range(stages) if cursor[s] < len(schedules[s])}
            raise RuntimeError(f"schedule deadlocks: stages wait at {stuck}")
    return spans


def bubble(spans: Sequence[Sequence[Span]]) -> float:
    """Mean over stages of idle time / makespan, where busy time is compute actions only."""
    makespan = max(span.end for stage in spans for span in stage)
    if makespan <= 0:
        return 0.0
    idle = [1.0 - sum(sp.end - sp.start for sp in stage if sp.action.kind in COMPUTE) / makespan
            for stage in spans]
    return sum(idle) / len(idle)
