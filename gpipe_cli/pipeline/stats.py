"""Per-step measurements: when each action ran, where the time went, bubble, memory; gathered to rank 0.

A stage's step splits into compute (forward, recompute, backward), waiting for a peer (blocked in a
receive, or in the gradient-norm collective until the slowest stage arrives: the bubble), communication
(sends and the gradient reductions), the optimizer update, and whatever else is left of the step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpipe_cli.pipeline.schedule import COMPUTE, Action, Kind

WAIT, COMM, OPTIMIZER = "wait", "comm", "optimizer"
PARTS = ("compute", WAIT, COMM, OPTIMIZER, "other")  # where a step's time goes, in display order
_WAITS = frozenset({Kind.RECV_FWD.value, Kind.RECV_BWD.value})
_SENDS = frozenset({Kind.SEND_FWD.value, Kind.SEND_BWD.value})


@dataclass(frozen=True)
class Event:
    """One executed action of one stage, in seconds from the step's start."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0  # the virtual stage (the stage itself unless interleaved)


class Timeline:
    """Records when each action of a step ran (wall clock on CPU, CUDA events for device compute)."""

    def __init__(self, stage: int, device: torch.device) -> None:
        self.stage, self.device = stage, device
        self.cuda = device.type == "cuda"
        self._origin = 0.0
        self._events: list[tuple[Action, float, float]] = []
        self._cuda: list[tuple[Action, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: tuple[Action, float, object] | None = None
        self._range: torch.profiler.record_function | None = None
        self._start_event: torch.cuda.Event | None = None
        self.extra: dict[str, float] = {}  # seconds outside the schedule's actions, by part

    def start(self) -> None:
        """Begin a step."""
        self._events.clear()
        self._cuda.clear()
        self.extra = {}
        self._origin = time.perf_counter()
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def now(self) -> float:
        """Seconds since the step began."""
        return time.perf_counter() - self._origin

    def begin(self, action: Action) -> None:
        """Mark the start of an action."""
        marker: object = None
        if self.cuda and action.kind in COMPUTE:
            marker = torch.cuda.Event(enable_timing=True)
            marker.record()  # type: ignore[attr-defined]
        self._open = (action, self.now(), marker)
        # A named range ("forward mb3") so a torch.profiler trace shows the schedule around its kernels.
        self._range = torch.profiler.record_function(f"{action.kind.value} mb{action.microbatch}")
        self._range.__enter__()

    def end(self) -> None:
        """Mark the end of the action begun last."""
        assert self._open is not None
        action, start, marker = self._open
        self._open = None
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if marker is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._cuda.append((action, marker, stop))  # type: ignore[arg-type]
        else:
            self._events.append((action, start, self.now()))

    def events(self) -> list[Event]:
        """Every action of the step (synchronises CUDA to read device times)."""
        out = [Event(self.stage, a.kind.value, a.microbatch, s, e, a.chunk) for a, s, e in self._events]
        if self._cuda:
            torch.cuda.synchronize(self.device)
            assert self._start_event is not None
            for action, begin, stop in self._cuda:
                s = self._start_event.elapsed_time(begin) / 1e3
                out.append(Event(self.stage, action.kind.value, action.microbatch, s,
                                 s + begin.elapsed_time(stop) / 1e3, action.chunk))
        return sorted(out, key=lambda e: e.start)

    @contextlib.contextmanager
    def span(self, part: str) -> Iterator[None]:
        """Count the time of a block outside the schedule (a reduction, the optimizer) towards `part`."""
        start = time.perf_counter()
        yield
        if self.cuda:  # device work is asynchronous: count it where it ran, not where it was queued
            torch.cuda.synchronize(self.device)
        self.extra[part] = self.extra.get(part, 0.0) + time.perf_counter() - start

    def busy(self, events: list[Event] | None = None) -> float:
        """Seconds spent in forward, recompute and backward."""
        kinds = {k.value for k in COMPUTE}
        return sum(e.end - e.start for e in (events or self.events()) if e.kind in kinds)

    def parts(self, events: list[Event]) -> tuple[float, float, float]:
        """Seconds waiting for a peer, communicating and in the optimizer during the step."""
        wait = sum(e.end - e.start for e in events if e.kind in _WAITS) + self.extra.get(WAIT, 0.0)
        comm = sum(e.end - e.start for e in events if e.kind in _SENDS) + self.extra.get(COMM, 0.0)
        return wait, comm, self.extra.get(OPTIMIZER, 0.0)


@dataclass
class StageStats:
    """One stage's measurements for one step."""

    stage: int
    replica: int
    step_time: float
    busy: float
    activation_peak: int
    rss_peak: int
    cuda_peak: int
    wait: float = 0.0        # blocked on a peer: in a receive or the gradient-norm collective
    comm: float = 0.0        # sending, and reducing gradients over replicas and shared copies
    optimizer: float = 0.0   # the update, when the engine ran it
    nonfinite_layer: int = -1  # the first layer in backward order with a non-finite gradient (-1: none)

    @property
    def idle(self) -> float:
        """Seconds not spent computing."""
        return max(self.step_time - self.busy, 0.0)

    @property
    def bubble(self) -> float:
        """Idle time as a fraction of the step."""
        return self.idle / self.step_time if self.step_time > 0 else 0.0

    @property
    def memory_peak(self) -> int:
        """The memory figure to report: the CUDA allocator peak, else stored activations."""
        return self.cuda_peak or self.activation_peak


@dataclass
class StepStats:
    """A whole step, as rank 0 sees it after gathering every rank's figures."""

    loss: float
    examples: int
    units: float
    step_time: float
    bubble_theory: float
    grad_norm: float
    stages: list[StageStats] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """The measured bubble: mean over stages of idle time / step time."""
        return sum(s.bubble for s in self.stages) / len(self.stages) if self.stages else 0.0

    @property
    def samples_per_s(self) -> float:
        """Examples trained per second, over all replicas."""
        return self.examples / self.step_time if self.step_time > 0 else 0.0

    @property
    def units_per_s(self) -> float:
        """Loss units (tokens for text) trained per second."""
        return self.units / self.step_time if self.step_time > 0 else 0.0

    def memory_peaks(self, replica: int = 0) -> list[int]:
        """Peak memory of each stage of one replica, in stage order."""
        return [s.memory_peak for s in self.of_replica(replica)]

    def of_replica(self, replica: int = 0) -> list[StageStats]:
        """The stages of one replica, in stage order."""
        return sorted((s for s in self.stages if s.replica == replica), key=lambda s: s.stage)

    def breakdown(self, step_time: float, replica: int = 0) -> dict[str, list[float]]:
        """Seconds of each part (`PARTS`) per stage of one replica; `other` is what is left of `step_time`."""
        stages = self.of_replica(replica)
        parts: dict[str, list[float]] = {"compute": [s.busy for s in stages], WAIT: [s.wait for s in stages],
                                         COMM: [s.comm for s in stages], OPTIMIZER: [s.optimizer for s in stages]}
        parts["other"] = [max(step_time - sum(p[i] for p in parts.values()), 0.0) for i in range(len(stages))]
        return parts

    def nonfinite(self) -> tuple[int, int] | None:
        """(stage, layer) of the first non-finite gradient in backward order, over every stage; None if none."""
        bad = [s for s in self.stages if s.nonfinite_layer >= 0]
        if not bad:
            return None
        first = max(bad, key=lambda s: s.nonfinite_layer)
        return first.stage, first.nonfinite_layer


_FIELDS = 14


def gather(mine: StageStats, loss: float, examples: int, units: float, grad_norm: float,
           bubble_theory: float, group: dist.ProcessGroup | None,
           events: list[Event] | None = None) -> StepStats | None:
    """Combine every rank's figures on rank 0 (others get None); events only when given."""
    row = torch.tensor([mine.stage, mine.replica, mine.step_time, mine.busy, mine.activation_peak,
                        mine.rss_peak, mine.cuda_peak, loss, examples, units, mine.wait, mine.comm,
                        mine.optimizer, mine.nonfinite_layer], dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        rows, all_events = [row], list(events or [])
    else:
        world = dist.get_world_size()
        rank = dist.get_rank()
        rows = [torch.empty(_FIELDS, dtype=torch.float64) for _ in range(world)]
        dist.gather(row, rows if rank == 0 else None, dst=0, group=group)
        all_events = []
        if events is not None:
            gathered: list[list[Event] | None] = [None] * world if rank == 0 else []
            dist.gather_object(events, gathered if rank == 0 else None, dst=0, group=group)
            all_events = [e for part in gathered if part for e in part]
        if rank != 0:
            return None
    stages = [StageStats(int(r[0]), int(r[1]), float(r[2]), float(r[3]), int(r[4]), int(r[5]), int(r[6]),
                         float(r[10]), float(r[11]), float(r[12]), int(r[13])) for r in rows]
    last = max(s.stage for s in stages)
    lasts = [r for r in rows if int(r[0]) == last]
    return StepStats(loss=float(sum(r[7] for r in lasts)), examples=int(sum(r[8] for r in lasts)),
                     units=float(sum(r[9] for r in lasts)), step_time=max(s.step_time for s in stages),
                     bubble_theory=bubble_theory, grad_norm=grad_norm, stages=stages, events=all_events)
