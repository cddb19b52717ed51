"""Pipeline schedules as data: one list of actions per stage, built once, read by everything.

GPipe fill-drain, K=3 stages, M=4 micro-batches (F forward, B backward, time flows right):

    stage 0  F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0
    stage 1  .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 ..
    stage 2  .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. ..

1F1B (PipeDream-flush) keeps at most K - stage micro-batches in flight:

    stage 0  F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
    stage 1  .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
    stage 2  .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

Zero-bubble (ZB-H1, Qi et al., 2024) splits each backward into Bi (the input gradient, which the
previous stage waits for) and W (the weight gradient, which nobody waits for). It runs 1F1B's order
with Bi in place of B, and stage s puts each W s backwards later: the Bs travel up the pipeline twice
as fast, and the Ws fill the slots where the stage would wait. Under 1F1B stage s holds K - s
micro-batches and stage 0 holds K, so s pending Ws keep every stage at stage 0's peak. Stage 0 lags by
nothing and keeps whole backwards. Compute order per stage, K=4, M=4:

    stage 0  F0 F1 F2 F3 B0 B1 B2 B3
    stage 1  F0 F1 F2 Bi0 F3 Bi1 W0 Bi2 W1 Bi3 W2 W3
    stage 2  F0 F1 Bi0 F2 Bi1 F3 Bi2 W0 Bi3 W1 W2 W3
    stage 3  F0 Bi0 F1 Bi1 F2 Bi2 F3 Bi3 W0 W1 W2 W3

Interleaved 1F1B gives each stage V chunks of layers, chunk c on stage c mod K (the last stage's
chunks feed the first stage's next ones): forwards go K micro-batches per chunk in turn, with a deeper
warm-up, and the fill and drain shrink V times. Compute order, K=2, V=2, M=2 (chunk after the slash):

    stage 0  F0/0 F1/0 F0/2 F1/2 B0/2 B1/2 B0/0 B1/0
    stage 1  F0/1 F1/1 F0/3 B0/3 F1/3 B1/3 B0/1 B1/1

Every schedule gives the same gradients. A schedule names receives and sends explicitly, and marks
which forwards keep no graph (rematerialised micro-batches, recomputed just before their backward),
so it can be printed, simulated, drawn and accounted for without processes; the runtime executes
exactly these lists, for training and for evaluation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does."""

    RECV_FWD = "recv_fwd"      # wait for the input activation from the previous stage
    FWD = "fwd"                # forward (on the last stage, with the loss)
    SEND_FWD = "send_fwd"      # post the output activation to the next stage
    RECOMPUTE = "recompute"    # rematerialise the activations from the stored boundary input
    RECV_BWD = "recv_bwd"      # wait for the output gradient from the next stage
    BWD = "bwd"                # full backward: input and weight gradients
    BWD_INPUT = "bwd_input"    # backward for the input gradient only; the graph stays for the W
    BWD_WEIGHT = "bwd_weight"  # backward for the weight gradients, freeing the graph
    SEND_BWD = "send_bwd"      # post the input gradient to the previous stage


COMPUTE = frozenset({Kind.FWD, Kind.RECOMPUTE, Kind.BWD, Kind.BWD_INPUT, Kind.BWD_WEIGHT})
GRADIENT = frozenset({Kind.BWD, Kind.BWD_INPUT})      # consume the output gradient, make the input's
RELEASE = frozenset({Kind.BWD, Kind.BWD_WEIGHT})      # the micro-batch's graph is gone afterwards
_SHORT = {Kind.RECV_FWD: "rf", Kind.FWD: "F", Kind.SEND_FWD: "sf", Kind.RECOMPUTE: "R", Kind.RECV_BWD: "rb",
          Kind.BWD: "B", Kind.BWD_INPUT: "Bi", Kind.BWD_WEIGHT: "W", Kind.SEND_BWD: "sb"}


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: what to do, to which micro-batch, on which chunk of layers.

    `chunk` is the virtual stage the action runs (the stage itself while every rank holds one chunk);
    `remat` marks a forward that keeps no graph, whose micro-batch is recomputed before its backward.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    remat: bool = False

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}"


Schedule = list[Action]
REMAT_MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


def check(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Refuse, with one line, a schedule that cannot run K stages x V chunks with M micro-batches."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule '{name}': allowed are {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (got {microbatches})")
    if virtual < 1:
        raise ValueError(f"virtual_stages must be >= 1 (got {virtual})")
    if virtual > 1 and name != "interleaved":
        raise ValueError(f"virtual_stages {virtual} needs schedule 'interleaved' (got '{name}')")
    if virtual > 1 and stages < 2:
        raise ValueError(f"virtual_stages {virtual} needs at least 2 partitions (got {stages})")
    if virtual > 1 and microbatches % stages:
        raise ValueError(f"the interleaved schedule needs microbatches to be a multiple of partitions "
                         f"(got M={microbatches}, K={stages})")


def _check(stage: int, stages: int, microbatches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}) (got {stage})")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (got {microbatches})")


Step = tuple[Kind, int, int]  # kind, micro-batch, chunk


def _interleaved(stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
    """Interleaved 1F1B (Narayanan et al., 2021): K micro-batches per chunk in turn, forwards ahead.

    The k-th forward of a rank runs chunk (k // K) mod V on micro-batch (k // KV) K + k mod K; the
    k-th backward the same in reverse chunk order. A deeper warmup than 1F1B's keeps every chunk fed.
    """
    total = microbatches * virtual

    def at(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, stages * virtual)
        v = within // stages
        return group * stages + within % stages, (virtual - 1 - v if backward else v) * stages + stage

    warmup = min((stages - stage - 1) * 2 + (virtual - 1) * stages, total)
    order: list[Step] = [(Kind.FWD, *at(k, False)) for k in range(warmup)]
    for j in range(total - warmup):
        order += [(Kind.FWD, *at(warmup + j, False)), (Kind.BWD, *at(j, True))]
    return order + [(Kind.BWD, *at(j, True)) for j in range(total - warmup, total)]


def _order(name: str, stage: int, stages: int, microbatches: int, virtual: int = 1) -> list[Step]:
    """The compute order of one stage (forwards and backwards), before remat and messages."""
    if name == "interleaved" and virtual > 1:
        return _interleaved(stage, stages, microbatches, virtual)
    if name == "gpipe":
        return [(Kind.FWD, i, stage) for i in range(microbatches)] + \
            [(Kind.BWD, i, stage) for i in reversed(range(microbatches))]
    # 1F1B: a warm-up of forwards, then each forward followed by the oldest backward, then the drain.
    warmup = min(stages - stage - 1, microbatches)
    order: list[Step] = [(Kind.FWD, i, stage) for i in range(warmup)]
    for j in range(microbatches - warmup):
        order += [(Kind.FWD, warmup + j, stage), (Kind.BWD, j, stage)]
    order += [(Kind.BWD, j, stage) for j in range(microbatches - warmup, microbatches)]
    return _defer_weights(order, stage) if name == "zero-bubble" else order


def _defer_weights(order: Sequence[Step], lag: int) -> list[Step]:
    """ZB-H1: each backward becomes its B, and its W goes right after the B `lag` backwards later.

    Stage s lags by s: under 1F1B it holds K - s micro-batches where stage 0 holds K, so s pending Ws
    keep every stage at stage 0's peak. The last `lag` Ws end the list, where the stage would otherwise
    wait for the step to end. With no lag the backward stays whole (one autograd pass, same order).
    """
    if lag == 0:
        return list(order)
    out: list[Step] = []
    done: list[tuple[int, int]] = []  # (micro-batch, chunk) of each B, in order
    for kind, mb, chunk in order:
        if kind != Kind.BWD:
            out.append((kind, mb, chunk))
            continue
        out.append((Kind.BWD_INPUT, mb, chunk))
        done.append((mb, chunk))
        if len(done) > lag:
            out.append((Kind.BWD_WEIGHT, *done[-lag - 1]))
    return out + [(Kind.BWD_WEIGHT, *key) for key in done[max(0, len(done) - lag):]]


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


def _forward(chunk: int, chunks: int, mb: int, remat: bool = False) -> list[Action]:
    first, last = chunk == 0, chunk == chunks - 1
    return ([] if first else [Action(Kind.RECV_FWD, mb, chunk)]) + [Action(Kind.FWD, mb, chunk, remat)] + \
        ([] if last else [Action(Kind.SEND_FWD, mb, chunk)])


def _gradient(chunk: int, chunks: int, kind: Kind, mb: int, remat: bool) -> list[Action]:
    first, last = chunk == 0, chunk == chunks - 1
    # Recompute before waiting for the gradient, so the rematerialisation hides the wait.
    return ([Action(Kind.RECOMPUTE, mb, chunk)] if remat else []) + \
        ([] if last else [Action(Kind.RECV_BWD, mb, chunk)]) + [Action(kind, mb, chunk)] + \
        ([] if first else [Action(Kind.SEND_BWD, mb, chunk)])


def build(name: str, stage: int, stages: int, microbatches: int, checkpoint: str = "except_last",
          virtual: int = 1) -> Schedule:
    """The action list of one stage (of V chunks) for a training step; rematerialisation is decided here, once."""
    _check(stage, stages, microbatches)
    check(name, stages, microbatches, virtual)
    order = _order(name, stage, stages, microbatches, virtual)
    remat = _remat(checkpoint, order)
    chunks = stages * virtual
    actions: Schedule = []
    for kind, mb, chunk in order:
        if kind == Kind.FWD:
            actions += _forward(chunk, chunks, mb, (mb, chunk) in remat)
        elif kind in GRADIENT:
            actions += _gradient(chunk, chunks, kind, mb, (mb, chunk) in remat)
        else:
            actions.append(Action(kind, mb, chunk))
    return actions


def forward_only(stage: int, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The action list of one stage for an evaluation (no-grad) pass: each chunk in turn, any M."""
    _check(stage, stages, microbatches)
    chunks = stages * virtual
    return [a for v in range(virtual) for mb in range(microbatches)
            for a in _forward(v * stages + stage, chunks, mb)]


def build_all(name: str, stages: int, microbatches: int, checkpoint: str = "except_last",
              virtual: int = 1) -> list[Schedule]:
    """The action lists of every stage."""
    return [build(name, s, stages, microbatches, checkpoint, virtual) for s in range(stages)]


def rematerialised(schedule: Schedule) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs whose forward keeps no graph, as the list marks them."""
    return {(a.microbatch, a.chunk) for a in schedule if a.kind == Kind.FWD and a.remat}


def owner(chunk: int, stages: int) -> int:
    """The stage (rank in a replica) that runs `chunk`: chunks go round-robin over the K stages."""
    return chunk % stages


def peer(action: Action, stages: int) -> tuple[int, int]:
    """The stage and chunk at the other end of a message action."""
    chunk = action.chunk + (1 if action.kind in (Kind.SEND_FWD, Kind.RECV_BWD) else -1)
    return owner(chunk, stages), chunk


def message_order(schedule: Schedule, kind: Kind) -> list[int]:
    """The micro-batches of one kind of message, in the order the stage handles them."""
    return [a.microbatch for a in schedule if a.kind == kind]


def render(schedules: Sequence[Schedule]) -> str:
    """The action lists as text, one line per stage (with each action's chunk when a stage runs several)."""
    lines = []
    for s, acts in enumerate(schedules):
        several = len({a.chunk for a in acts}) > 1
        lines.append(f"stage {s}: " + " ".join(f"{a}/c{a.chunk}" if several else str(a) for a in acts))
    return "\n".join(lines)


_UNIT = {Kind.FWD: 1.0, Kind.RECOMPUTE: 1.0, Kind.BWD: 2.0, Kind.BWD_INPUT: 1.0, Kind.BWD_WEIGHT: 1.0}


@functools.lru_cache(maxsize=256)
def theoretical_bubble(stages: int, microbatches: int, name: str = "gpipe", virtual: int = 1) -> float:
    """A schedule's idle fraction for equal stage costs (backward = 2 forwards), free messages, no remat.

    GPipe and 1F1B: (K-1)/(M+K-1). Other schedules: their own action lists run on ideal devices, each of
    the V chunks of a stage costing 1/V of it (zero-bubble, B and W one forward each: (K-1)/(3M+K-1)).
    """
    if name in ("gpipe", "1f1b") or (name == "interleaved" and virtual == 1):
        return (stages - 1) / (microbatches + stages - 1)
    plans = build_all(name, stages, microbatches, "never", virtual)
    return bubble(simulate(plans, lambda stage, action: _UNIT.get(action.kind, 0.0) / virtual))


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
    arrival: dict[tuple[int, Kind, int, int], float] = {}
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
                    key = (s, action.kind, action.chunk, action.microbatch)
                    if key not in arrival:
                        break
                    end = max(start, arrival[key])
                elif action.kind in (Kind.SEND_FWD, Kind.SEND_BWD):
                    end = start
                    other, chunk = peer(action, stages)
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
