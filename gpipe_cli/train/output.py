"""A run whose reader has gone (`gpipe train | head`): its output is dropped and it stops as a SIGTERM stops it."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import stat
import sys
from collections.abc import Callable
from typing import Any, TextIO

CLOSED = signal.SIGPIPE  # the name a stop for a closed output goes by: its exit code is 141, as a shell's


class _Guarded:
    """A text stream that, once a write finds its reader gone, drops what follows and calls `closed` once."""

    def __init__(self, stream: TextIO, closed: Callable[[], None], advisory: bool = False) -> None:
        self._stream, self.closed_by, self._gone = stream, closed, False
        self._pipe = _watch(stream)  # asked once a step: what it is is found once here
        # Standard error only advises: a write it refuses otherwise (`2>/dev/full`, a descriptor open for reading)
        # is dropped, where it stopped a rank before its checkpoint.
        self._advisory = advisory

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._failed(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._failed(exc)

    def check(self) -> None:
        """Call `closed` now if this stream is a pipe whose reader has gone, though nothing was written since."""
        if self._pipe is not None and not self._gone \
                and any(events & select.POLLERR for _, events in self._pipe.poll(0)):  # a pipe's writer, reader gone
            self._lost()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _failed(self, exc: OSError) -> None:
        if _reader_gone(exc):
            self._lost()
        elif self._advisory:
            to_null(self._stream)
        else:
            raise exc

    def _lost(self) -> None:
        if self._gone:
            return
        self._gone = True
        to_null(self._stream)
        self.closed_by()


def to_null(stream: TextIO) -> None:
    """Point a stream at /dev/null: what is still buffered, and every later write, goes nowhere, not failing."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


def _reader_gone(exc: OSError) -> bool:
    """Whether a write failed for want of a reader: a closed pipe, or a terminal that hung up (EIO)."""
    return isinstance(exc, BrokenPipeError) or exc.errno == errno.EIO


def _watch(stream: TextIO) -> Any:
    """A poll of `stream`'s descriptor when it is a pipe (None for a terminal, a file or no descriptor)."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
    except (OSError, ValueError, AttributeError):
        return None
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return poll


def guard_output(closed: Callable[[], None] = lambda: None) -> None:
    """Standard output and error from now on: a closed pipe calls `closed` once instead of raising in the printer."""
    # Both: `gpipe train 2>&1 | head` closes the one the stop's own lines go to.
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if isinstance(stream, _Guarded):  # a rank under torchrun: the command guarded it first
            stream.closed_by = closed
        elif stream is not None:
            setattr(sys, name, _Guarded(stream, closed, advisory=name == "stderr"))
        else:  # started with it closed (`>&-`): what is printed goes nowhere
            setattr(sys, name, open(_null_on(fd), "w", closefd=False))  # noqa: SIM115 (the process's own stream)


def check_readers() -> None:
    """Call the guard's `closed` for a pipe whose reader has gone, before anything more is printed there."""
    # Once a step: a run that prints rarely (the live view into a pipe, a large train.log_every) stops after
    # this step, not at its next line, which may be hundreds of steps on.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, _Guarded):
            stream.check()


def _null_on(fd: int) -> int:
    """`fd`, made /dev/null when it is closed: else the next file opened (a lock, a checkpoint) would take it."""
    try:
        os.fstat(fd)
        return os.open(os.devnull, os.O_WRONLY)  # taken already: leave it be
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # as the closed one would have been: the ranks print there too
        return fd


def stop_run() -> None:
    """Stop this rank as its SIGTERM handler would: at once during set-up, else after the step with a checkpoint."""
    # The handler in place knows which of the two applies (pipeline/stopping.py before the first step, then
    # train/signals.py); it is told SIGPIPE so that the stop says what caused it.
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(CLOSED, None)
