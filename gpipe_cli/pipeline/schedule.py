"""Pipeline schedules as data: one list of actions per stage, built once, read by everything.

A schedule (pipeline/schedules/) states each stage's order of forwards and backwards; here that order
becomes the stage's action list: receives and sends around each compute step, and the forwards that
keep no graph (rematerialised micro-batches, recomputed just before their backward). Every schedule
gives the same gradients. The lists can be printed, simulated, drawn and accounted for without
processes; the runtime executes exactly these lists, for training and for evaluation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpipe_cli.pipeline import placement as placement_
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.actions import COMPUTE, GRADIENT, RELEASE, Action, Kind, Step
from gpipe_cli.pipeline.config import REMAT_MODES, PipelineConfig

__all__ = ["COMPUTE", "GRADIENT", "RELEASE", "REMAT_MODES", "SCHEDULES", "Action", "Kind", "ActionList", "Span",
           "Step", "bubble", "build", "build_all", "check", "forward_only", "message_order", "owner", "peer",
           "rematerialised", "render", "simulate", "theoretical_bubble"]


ActionList = list[Action]
SCHEDULES = schedules.names()


def check(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Refuse, with one line, a schedule that cannot run K stages x V chunks with M micro-batches."""
    PipelineConfig(stages, microbatches, virtual=virtual, schedule=name)


def _check(stage: int, stages: int, microbatches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) (got {stage})")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (got {microbatches})")


def _remat(mode: str, order: Sequence[Step]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs a stage rematerialises under a mode.

    `except_last` skips the micro-batches whose backward directly follows their forward: keeping their
    activations costs nothing extra (GPipe: the last micro-batch; 1F1B: every one on the last stage).
    """
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


def _forward(chunk: int, chunks: int, mb: int, remat: bool = False,
             local: Callable[[int], bool] = lambda chunk: False) -> list[Action]:
    # A neighbouring chunk on this same stage hands over in memory: no message.
    first, last = chunk == 0, chunk == chunks - 1
    return ([] if first or local(chunk - 1) else [Action(Kind.RECV_FWD, mb, chunk)]) + \
        [Action(Kind.FWD, mb, chunk, remat)] + ([] if last or local(chunk + 1) else [Action(Kind.SEND_FWD, mb, chunk)])


def _gradient(chunk: int, chunks: int, kind: Kind, mb: int, remat: bool,
              local: Callable[[int], bool] = lambda chunk: False) -> list[Action]:
    first, last = chunk == 0, chunk == chunks - 1
    # Recompute before waiting for the gradient, so the rematerialisation hides the wait.
    return ([Action(Kind.RECOMPUTE, mb, chunk)] if remat else []) + \
        ([] if last or local(chunk + 1) else [Action(Kind.RECV_BWD, mb, chunk)]) + [Action(kind, mb, chunk)] + \
        ([] if first or local(chunk - 1) else [Action(Kind.SEND_BWD, mb, chunk)])


def _local(name: str, stage: int, stages: int) -> Callable[[int], bool]:
    """Whether a chunk runs on `stage` under the schedule's placement."""
    placement = schedules.get(name).placement
    return lambda chunk: owner(chunk, stages, placement) == stage


def build(name: str, stage: int, stages: int, microbatches: int, checkpoint: str = "except_last",
          virtual: int = 1) -> ActionList:
    """The action list of one stage (of V chunks) for a training step; rematerialisation is decided here, once."""
    _check(stage, stages, microbatches)
    check(name, stages, microbatches, virtual)
    order = schedules.get(name).order(stage, stages, microbatches, virtual)
    remat = _remat(checkpoint, order)
    chunks, local = stages * virtual, _local(name, stage, stages)
    actions: ActionList = []
    for kind, mb, chunk in order:
        if kind == Kind.FWD:
            actions += _forward(chunk, chunks, mb, (mb, chunk) in remat, local)
        elif kind in GRADIENT:
            actions += _gradient(chunk, chunks, kind, mb, (mb, chunk) in remat, local)
        else:
            actions.append(Action(kind, mb, chunk))
    return actions


def forward_only(stage: int, stages: int, microbatches: int, virtual: int = 1,
                 placement: str = "loop") -> ActionList:
    """The action list of one stage for an evaluation (no-grad) pass: each chunk in turn, any M."""
    _check(stage, stages, microbatches)
    chunks = stages * virtual

    def local(chunk: int) -> bool:
        return owner(chunk, stages, placement) == stage

    return [a for chunk in placement_.chunks_of(stage, stages, virtual, placement) for mb in range(microbatches)
            for a in _forward(chunk, chunks, mb, local=local)]


def build_all(name: str, stages: int, microbatches: int, checkpoint: str = "except_last",
              virtual: int = 1) -> list[ActionList]:
    """The action lists of every stage."""
    return [build(name, s, stages, microbatches, checkpoint, virtual) for s in range(stages)]


def rematerialised(schedule: ActionList) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs whose forward keeps no graph, as the list marks them."""
    return {(a.microbatch, a.chunk) for a in schedule if a.kind == Kind.FWD and a.remat}


def owner(chunk: int, stages: int, placement: str = "loop") -> int:
    """The stage (rank in a replica) that runs `chunk` under `placement`."""
    return placement_.owner(chunk, stages, placement)


def peer(action: Action, stages: int, placement: str = "loop") -> tuple[int, int]:
    """The stage and chunk at the other end of a message action."""
    chunk = action.chunk + (1 if action.kind in (Kind.SEND_FWD, Kind.RECV_BWD) else -1)
    return owner(chunk, stages, placement), chunk


def message_order(schedule: ActionList, kind: Kind) -> list[int]:
    """The micro-batches of one kind of message, in the order the stage handles them."""
    return [a.microbatch for a in schedule if a.kind == kind]


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
    """A schedule's idle fraction for equal stage costs (backward = 2 forwards), free messages, no remat.

    Its closed form where it has one (GPipe and 1F1B: (K-1)/(M+K-1)); otherwise its action lists run on
    ideal devices, each of the V chunks of a stage costing 1/V of it (zero-bubble, B and W one forward
    each: (K-1)/(3M+K-1)).
    """
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


Cost = Callable[[int, Action], float]


def simulate(lists: Sequence[ActionList], cost: Cost, latency: Cost | None = None,
             placement: str = "loop") -> list[list[Span]]:
    """Run the action lists on ideal devices: compute takes `cost`, a message arrives `latency` after its send.

    Sends do not block (as in the runtime); a receive waits for the matching send. Returns the spans
    of every action of every stage.
    """
    latency = latency or (lambda stage, action: 0.0)
    stages = len(lists)
    arrival: dict[tuple[int, Kind, int, int], float] = {}
    spans: list[list[Span]] = [[] for _ in range(stages)]
    cursor, clock = [0] * stages, [0.0] * stages
    remaining = sum(len(s) for s in lists)
    while remaining:
        progressed = False
        for s in range(stages):
            while cursor[s] < len(lists[s]):
                action = lists[s][cursor[s]]
                start = clock[s]
                if action.kind in (Kind.RECV_FWD, Kind.RECV_BWD):
                    key = (s, action.kind, action.chunk, action.microbatch)
                    if key not in arrival:
                        break
                    end = max(start, arrival[key])
                elif action.kind in (Kind.SEND_FWD, Kind.SEND_BWD):
                    end = start
                    other, chunk = peer(action, stages, placement)
                    recv = Kind.RECV_FWD if action.kind == Kind.SEND_FWD else Kind.RECV_BWD
                    arrival[(other, recv, chunk, action.microbatch)] = end + latency(s, action)
                else:
                    end = start + cost(s, action)
                spans[s].append(Span(s, action, start, end))
                clock[s] = end
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(lists[s][cursor[s]]) for s in range(stages) if cursor[s] < len(lists[s])}
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
