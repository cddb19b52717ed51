"""What the engine tells layers about the micro-batch they are running."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
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


@contextlib.contextmanager
def microbatch(step: int, offset: int, recomputing: bool = False) -> Iterator[MicroBatchInfo]:
    """Run the enclosed forward as micro-batch `offset` of optimizer step `step`."""
    previous = _state.current
    info = _state.current = MicroBatchInfo(step=step, offset=offset, recomputing=recomputing)
    try:
        yield info
    finally:
        _state.current = previous
