"""The stop signal (Ctrl-C, SIGTERM, SIGHUP) a rank received, and what it does before the rank has work to finish."""

# Importing this module costs nothing: the handler is in place before torch is imported.
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import NoReturn

GRACE_S = 2.0
STOP_ASKED = "stop-asked"  # beside the marker: the signal of a stop the launcher saw through before the first step
# SIGHUP: the terminal closed, or the ssh session dropped; the run saves and stops as a scheduler's SIGTERM asks.
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received = 0
_announced = False
_pipe: tuple[int, int] | None = None  # (read, write) ends while the set-up's deadline thread waits
_marker: Path | None = None
_deferred = False  # inside `deferred()`: the first signal raises once the block ends
_undo: list[Callable[[], None]] = []  # what an abrupt exit takes back first (a run directory's claim, its set-up)


class StoppedEarly(BaseException):  # not an Exception: no `except Exception` on the way may swallow it
    """A stop signal before the first step: the rank ends without a report."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first step was done")
        self.signum = signum


def on_abrupt_exit(undo: Callable[[], None]) -> Callable[[], None]:
    """Have `undo` run should this process end at once (`abrupt_exit`); return what cancels that."""
    _undo.append(undo)
    return lambda: _undo.remove(undo) if undo in _undo else None


def abrupt_exit(code: int) -> NoReturn:
    """End this process at once with `code`, without unwinding, once what `on_abrupt_exit` asked is undone."""
    for undo in reversed(_undo):
        with contextlib.suppress(Exception):  # ending is what matters now
            undo()
    os._exit(code)


def note(signum: int) -> None:
    """Remember the first stop signal (on tear-down, a vanished peer is then no news)."""
    global _received
    _received = _received or signum


def received() -> int:
    """The first stop signal this rank received (0: none)."""
    return _received


def ending() -> int:
    """The signal that is ending this rank before its first step (0: none)."""
    # An error raised meanwhile is its consequence, even one a library calling back into Python made of StoppedEarly.
    return _received if _pipe is not None else 0


def _announce(signum: int) -> None:
    global _announced
    # A person pressed Ctrl-C: answer at once. A SIGTERM may be the launcher tearing the job down after another
    # rank failed, which that rank reports.
    if not _announced and signum == signal.SIGINT:
        _announced = True
        say_stopping_now("SIGINT")


def say_stopping_now(name: str) -> None:
    """Say that signal `name` stops the job before its first step is done."""
    say_stop(f"{name}: stopping now, before the first step is done (nothing to save yet)")


def say_stop(text: str) -> None:
    """The line that answers a stop signal, on a line of its own: past a terminal's ^C echo, alone in a file."""
    print(f"{chr(10) if sys.stderr.isatty() else ''}[gpipe] {text}", file=sys.stderr, flush=True)


def until_started(announce: bool, marker: Path | None = None) -> None:
    """Until `started()` (which creates `marker`), Ctrl-C or SIGTERM ends this rank quietly (main thread only)."""
    global _pipe, _marker
    _marker = marker or _marker

    def handle(signum: int, frame: FrameType | None) -> None:
        if _finalizing(frame):  # what a __del__ raises is printed and dropped: the signal comes again just after
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return
        if _received:
            abrupt_exit(128 + signum)
        note(signum)
        if announce:
            _announce(signum)
        if not _deferred:
            raise StoppedEarly(signum)

    # Python runs a handler only between the main thread's bytecodes, and a main thread waiting inside torch (for
    # a peer, on the job's store) may not return for minutes: the signal also goes to a pipe (from C), whose
    # reader thread ends the rank `GRACE_S` later.
    if _pipe is None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)
        _pipe = (read, write)
        threading.Thread(target=_deadline, args=(read, announce), name="set-up-stop", daemon=True).start()
    for sig in STOPS:  # last: the caller catches StoppedEarly around this call
        signal.signal(sig, handle)


def _finalizing(frame: FrameType | None) -> bool:
    """Whether the main thread was stopped inside an object's `__del__` (directly or below it)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Code C++ calls back into (torch's import) sees no `StoppedEarly`: a stop signal raises when the block ends."""
    # An exception raised there aborts the process (SIGABRT and a frame dump); the deadline may still end the rank.
    global _deferred
    _deferred = True
    try:
        yield
    finally:
        _deferred = False
    if _received and _pipe is not None:
        raise StoppedEarly(_received)


def _deadline(read: int, announce: bool) -> None:
    """End the rank `GRACE_S` after a stop signal that its main thread has not acted on."""
    while True:
        try:
            data = os.read(read, 1)
        except OSError:
            return
        if not data or _pipe is None:
            os.close(read)
            return  # set-up is over
        if data[0] not in STOPS:
            continue
        time.sleep(GRACE_S)
        if _pipe is None:
            return
        if announce:
            _announce(data[0])
        sys.stdout.flush()
        abrupt_exit(128 + data[0])


def asked() -> int:
    """The stop signal this node's launcher saw through before any of its ranks had a step to finish (0: none)."""
    if _marker is None:
        return 0
    try:
        return int(_marker.with_name(STOP_ASKED).read_text())
    except (OSError, ValueError):
        return 0


def ask(marker: Path, signum: int) -> None:
    """Leave beside `marker` the stop signal `signum` for the ranks that arm after it (launcher side)."""
    part = marker.with_name(f".{STOP_ASKED}.{os.getpid()}")
    with contextlib.suppress(OSError):  # written whole: a rank reading it never sees it empty
        part.write_text(str(signum))
        os.replace(part, marker.with_name(STOP_ASKED))


# Ranks hand over together, at the end of the step they share, so none stops for good while a peer means to finish
# a step and save it.
def started() -> None:
    """The first step is done and the training loop's handler is in place: no deadline any more."""
    global _pipe
    if _marker is not None:
        _marker.touch()  # tells the launcher
    if _pipe is None:
        return
    read, write = _pipe
    _pipe = None
    signal.set_wakeup_fd(-1)
    os.close(write)  # the deadline thread reads the end of the pipe and returns
