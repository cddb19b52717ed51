"""Per-step measurements: when each action ran, where the time went, bubble, memory; gathered to rank 0."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from gpipe_cli.pipeline.device import Marker
from gpipe_cli.pipeline.fabric import Fabric
from gpipe_cli.pipeline.schedule import Action, Kind, Span, seconds

WAIT, COMM, OPTIMIZER = "wait", "comm", "optimizer"
SHARED = "shared"  # a tied weight's gradient sum: part waiting for its other holders, part sending (see StageStats)
PARTS = ("compute", WAIT, COMM, OPTIMIZER, "other")  # where a step's time goes, in display order


class Timeline:
    """When each action of a step ran: device markers around every action, read once the step is over."""

    def __init__(self, stage: int, device: torch.device) -> None:
        self.stage, self.device = stage, device
        self._origin = Marker(device)
        self._spans: list[tuple[Action, Marker, Marker]] = []
        self._extra: list[tuple[str, Marker, Marker]] = []
        self._open: tuple[Action, Marker, object] | None = None
        self._ranges = False

    def start(self) -> None:
        """Begin a step."""
        self._spans, self._extra = [], []
        self._origin = Marker(self.device)
        # A named range per action ("fwd mb3") only while a profiler records: it costs a call per action.
        self._ranges = torch.autograd._profiler_enabled()

    def begin(self, action: Action) -> None:
        """Mark the start of an action."""
        scope: object = None
        if self._ranges:
            scope = torch.profiler.record_function(f"{action.kind.value} mb{action.microbatch}")
            scope.__enter__()  # type: ignore[attr-defined]
        self._open = (action, Marker(self.device), scope)

    def end(self) -> None:
        """Mark the end of the action begun last."""
        assert self._open is not None
        action, begin, scope = self._open
        self._open = None
        self._spans.append((action, begin, Marker(self.device)))
        if scope is not None:
            scope.__exit__(None, None, None)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def span(self, part: str) -> Iterator[None]:
        """Count the time of a block outside the schedule (a reduction, the optimizer) towards `part`."""
        begin = Marker(self.device)
        yield
        self._extra.append((part, begin, Marker(self.device)))

    def finish(self) -> StepTimes:
        """The step's markers, to read once the device passed the last (see `StepTimes.read`)."""
        return StepTimes(self.stage, self._origin, Marker(self.device), list(self._spans), list(self._extra))


@dataclass
class StepTimes:
    """One step's markers; their times are read after the device passed `end`."""

    stage: int
    origin: Marker
    end: Marker
    spans: list[tuple[Action, Marker, Marker]]
    extra: list[tuple[str, Marker, Marker]]

    @property
    def step_time(self) -> float:
        """Seconds from the step's start to its end."""
        return self.origin.seconds_to(self.end)

    def events(self) -> list[Span]:
        """Every action of the step, in seconds from its start."""
        return [Span(self.stage, action, start, start + begin.seconds_to(stop))
                for action, begin, stop in self.spans for start in [self.origin.seconds_to(begin)]]

    def parts(self, events: list[Span]) -> tuple[float, float, float]:
        """Seconds waiting for a peer, communicating and in the optimizer during the step."""
        wait = seconds(events, (Kind.RECV_FWD, Kind.RECV_BWD)) + self.seconds_in(WAIT)
        comm = seconds(events, (Kind.SEND_FWD, Kind.SEND_BWD)) + self.seconds_in(COMM)
        return wait, comm, self.seconds_in(OPTIMIZER)

    def seconds_in(self, part: str) -> float:
        """Seconds in the blocks counted towards `part`."""
        return sum(begin.seconds_to(stop) for name, begin, stop in self.extra if name == part)


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
    comm: float = 0.0        # sending, and reducing gradients over replicas
    optimizer: float = 0.0   # the update, when the engine ran it
    nonfinite_layer: int = -1  # the first layer in backward order with a non-finite gradient (-1: none)
    offloaded_peak: int = 0  # activation bytes that waited in host memory at once (pipeline.offload)
    # In a tied weight's gradient sum, neither wait nor comm yet: a holder that finished its backward early
    # waits there for the others (the pipeline's drain), so the holders' figures together tell the two apart.
    shared: float = 0.0

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
    events: list[Span] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """The measured bubble: mean over stages of idle time / step time."""
        return sum(s.bubble for s in self.stages) / len(self.stages) if self.stages else 0.0

    def of_replica(self, replica: int = 0) -> list[StageStats]:
        """The stages of one replica, in stage order."""
        return sorted((s for s in self.stages if s.replica == replica), key=lambda s: s.stage)

    def nonfinite(self) -> tuple[int, int] | None:
        """(stage, layer) of the first non-finite gradient in backward order, over every stage; None if none."""
        first = max((s for s in self.stages if s.nonfinite_layer >= 0), key=lambda s: s.nonfinite_layer, default=None)
        return None if first is None else (first.stage, first.nonfinite_layer)


_FIELDS = dataclasses.fields(StageStats)


def gather(mine: StageStats, loss: float, examples: int, units: float, grad_norm: float,
           bubble_theory: float, fabric: Fabric | None,
           events: list[Span] | None = None) -> StepStats | None:
    """Combine every rank's figures on rank 0 (others get None), over the control plane; events only when given."""
    # Field by field: astuple deep-copies each one, and they are numbers.
    row = torch.tensor([*(getattr(mine, f.name) for f in _FIELDS), loss, examples, units], dtype=torch.float64)
    if fabric is None:
        rows, all_events = [row], list(events or [])
    else:
        gathered_rows = fabric.gather_rows(row)
        parts = fabric.gather_objects(events) if events is not None else None
        if gathered_rows is None:
            return None
        rows = gathered_rows
        all_events = [e for part in parts or [] if part for e in part]
    # The row is all float64: the fields declared int (a string where annotations are lazy) are read back as int.
    names, values = [f.name for f in _FIELDS], [r.tolist() for r in rows]
    whole = {f.name for f in _FIELDS if f.type in ("int", int)}
    stages = [StageStats(**{k: int(v) if k in whole else v for k, v in zip(names, r)}) for r in values]
    # Only the ranks running the last chunk (stage K-1 in a loop, stage 0 in a V) bring a loss and counts.
    total_loss, total_examples, total_units = (sum(r[i] for r in values) for i in range(len(names), len(names) + 3))
    return StepStats(loss=float(total_loss), examples=int(total_examples), units=float(total_units),
                     step_time=max(s.step_time for s in stages),
                     bubble_theory=bubble_theory, grad_norm=grad_norm, stages=stages, events=all_events)
