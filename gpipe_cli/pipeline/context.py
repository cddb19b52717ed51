"""What the engine tells layers about the micro-batch they are running."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchInfo:
    """The step, the global index of the micro-batch's first example, and whether this is a recompute."""

    step: int
    offset: int
    recomputing: bool = False


_current: MicroBatchInfo | None = None


def current() -> MicroBatchInfo | None:
    """Return the micro-batch being run, or None outside the engine."""
    return _current


def is_recomputing() -> bool:
    """Tell a layer whether this forward is the rematerialization of an earlier one."""
    return _current is not None and _current.recomputing


@contextlib.contextmanager
def microbatch(step: int, offset: int, recomputing: bool = False) -> Iterator[MicroBatchInfo]:
    """Run the enclosed forward as micro-batch `offset` of optimizer step `step`."""
    global _current
    previous = _current
    _current = MicroBatchInfo(step=step, offset=offset, recomputing=recomputing)
    try:
        yield _current
    finally:
        _current = previous
