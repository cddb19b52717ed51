"""Ctrl-C that cannot be lost while a command measures.

The engine's memory meter releases its records in `__del__`, and Python ignores a KeyboardInterrupt raised
there; so a measuring command also remembers the signal and checks it between measurements.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

_interrupted = False


def _on_interrupt(signum: int, frame: object) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within it, Ctrl-C raises KeyboardInterrupt as usual and is also remembered for `check`."""
    global _interrupted
    _interrupted = False
    previous = signal.signal(signal.SIGINT, _on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check() -> None:
    """Raise a Ctrl-C that arrived but was swallowed on the way."""
    if _interrupted:
        raise KeyboardInterrupt
