"""What the engine tells layers about the micro-batch they are running."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchInfo:
    """The step, the global index of the micro-batch's first example, and whether this is a recompute."""

    step: int
    offset: int
    recomputing: bool = False


class _State(threading.local):
    current: MicroBatchInfo | None = None


_state = _State()  # per thread: ranks run as threads of one process in tests


def current() -> MicroBatchInfo | None:
    """Return the micro-batch being run, or None outside the engine."""
    return _state.current


def is_recomputing() -> bool:
    """Tell a layer whether this forward is the rematerialization of an earlier one."""
    info = _state.current
    return info is not None and info.recomputing


class Running:
    """Within it, layers see `info` as the micro-batch they run (an object: entered once per forward)."""

    __slots__ = ("info", "previous", "entered")

    def __init__(self, info: MicroBatchInfo) -> None:
        self.info = info
        self.previous: MicroBatchInfo | None = None
        self.entered = False

    def __enter__(self) -> MicroBatchInfo:
        if self.entered:  # one slot for what it replaced: entered again, it would never put that back
            raise RuntimeError("a micro-batch context is entered once at a time")
        self.entered = True
        self.previous, _state.current = _state.current, self.info
        return self.info

    def __exit__(self, *exc: object) -> None:
        _state.current, self.entered = self.previous, False


def microbatch(step: int, offset: int, recomputing: bool = False) -> Running:
    """Run the enclosed forward as micro-batch `offset` of optimizer step `step`."""
    return Running(MicroBatchInfo(step=step, offset=offset, recomputing=recomputing))
