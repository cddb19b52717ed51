"""Ctrl-C that cannot be lost while a command measures, and SIGTERM or SIGHUP that stop a command as Ctrl-C does."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

_interrupted = False
_terminated = 0  # the SIGTERM or SIGHUP that stopped the command (0: none, or Ctrl-C)
_own_term = False  # the next SIGTERM is this process's own, passing a Ctrl-C on: it stays Ctrl-C's
_told = False  # the stop was already told in a line of its own: `say_stopped` adds none
_since = 0.0  # when the last stop was raised (time.monotonic)
ECHO_S = 1.0  # a stop signal this soon after one raised is the same one come twice
# A closed terminal or a dropped ssh session (SIGHUP) stops a command as a scheduler's SIGTERM does.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


# SIGTERM would end the process where it stands, leaving temporary files: as a KeyboardInterrupt it takes Ctrl-C's way.
def _on_interrupt(signum: int, frame: object) -> None:
    global _since
    echo = _interrupted and time.monotonic() - _since < ECHO_S
    _remember(signum, frame)
    if echo:  # the same Ctrl-C come twice (`timeout` passes on the one the terminal sent): raised while the first
        return  # unwound, it cut its line short, or said it a second time
    _since = time.monotonic()
    raise KeyboardInterrupt


def _remember(signum: int, frame: object) -> None:
    global _interrupted, _terminated, _own_term
    _interrupted = True
    if signum == signal.SIGTERM and _own_term:
        _own_term = False
        return
    _terminated = _terminated or (signum if signum in TERMINATING else 0)


def term_self() -> None:
    """Send this process SIGTERM to pass a Ctrl-C on: the command still ends as Ctrl-C ends it (130)."""
    global _own_term
    _own_term = True
    os.kill(os.getpid(), signal.SIGTERM)


def told() -> None:
    """The stop has been told in its own line: the command's closing line would say it twice."""
    global _told
    _told = True


def take_signal(handler: signal.Handlers | object, signum: int = signal.SIGINT) -> object:
    """Install `handler` for `signum` (SIGINT) unless the signal is ignored; return the handler it had."""
    current = signal.getsignal(signum)
    # A command started with SIGINT ignored (`nohup`, a script's background job) keeps ignoring it, as
    # its user asked: the terminal's Ctrl-C is meant for the foreground job, not for this one. So does one
    # started with SIGHUP ignored (`nohup`): it outlives its terminal. SIGTERM still stops either.
    if current is not signal.SIG_IGN or signum == signal.SIGTERM:
        signal.signal(signum, handler)  # type: ignore[arg-type]
    return current


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within it, Ctrl-C raises KeyboardInterrupt as usual and is also remembered for `check`."""
    check()  # one that arrived before, while the command loaded, and was lost there
    previous = take_signal(_on_interrupt)
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_unraisable(hook)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)  # type: ignore[arg-type]
        sys.unraisablehook = hook


# The engine's memory meter releases its records in `__del__`, where Python drops a KeyboardInterrupt: measuring
# commands call this between measurements.
def check() -> None:
    """Raise a Ctrl-C that arrived but was swallowed on the way."""
    if _interrupted:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within it stop signals are only remembered; leaving it whole, one that came raises KeyboardInterrupt."""
    # For C++ code that calls back into Python (pyarrow writing through fsspec): a KeyboardInterrupt raised
    # there becomes an error of its own, is swallowed, or aborts the process.
    previous = take_signal(_remember), [take_signal(_remember, signum) for signum in TERMINATING]
    try:
        yield
    finally:
        take_signal(previous[0])
        for signum, handler in zip(TERMINATING, previous[1], strict=True):
            signal.signal(signum, handler)  # type: ignore[arg-type]
    check()


def interrupted() -> bool:
    """Whether Ctrl-C or SIGTERM arrived: an exception after it is taken for its consequence."""
    # Libraries loading at that moment turn the KeyboardInterrupt into their own errors (pydantic's schema
    # errors, RecursionError, RuntimeError from class creation), or swallow it.
    return _interrupted


def stop_on_signals() -> None:
    """From now on Ctrl-C (unless ignored), SIGTERM and SIGHUP stop this process in one line, remembered for `check`."""
    take_signal(_on_interrupt)
    for signum in TERMINATING:
        take_signal(_on_interrupt, signum)
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


def _quiet_unraisable(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    """`previous`, less the tracebacks of KeyboardInterrupts raised in finalizers (`check` raises them later)."""
    if getattr(previous, "quiet", False):
        return previous

    def hook(unraisable: Any) -> object:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            return None
        return previous(unraisable)

    hook.quiet = True  # type: ignore[attr-defined]
    return hook


def speaks_for_node() -> bool:
    """Whether this process says what every rank of its node would say alike: outside torchrun, or local rank 0."""
    return "WORLD_SIZE" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0"


# Commands that never write a file: "nothing was written" would say that they might have.
WRITES_NO_FILE = frozenset({"gpipe predict"})


def say_stopped(command: str) -> None:
    """Say on stderr, in the one line every command uses, that a Ctrl-C or SIGTERM stopped `command` (or `gpipe`)."""
    # stderr: a command's output piped into a file stays its figures alone. Under torchrun, once a node: its agent
    # stops every rank alike, e.g. the others once one has refused the recipe.
    if speaks_for_node() and not _told:
        kept = "" if command in WRITES_NO_FILE else "; nothing was written"
        print(f"{command}: interrupted{kept}", file=sys.stderr, flush=True)


def exit_code(code: int) -> int:
    """`code`, with a stop that SIGTERM or SIGHUP caused reported as 128 + that signal rather than Ctrl-C's 130."""
    return 128 + _terminated if _terminated and code == 128 + signal.SIGINT else code


def finishing() -> None:
    """Results are being written: no stop signal stops the command any more, so it says truly what it wrote."""
    check()  # one that came before, even one a library lost on the way, stops it with nothing written
    ignore_stops()


def ignore_stops() -> None:
    """From now on no stop signal stops this process: what it started has ended, and it is saying what is left."""
    for signum in (signal.SIGINT, *TERMINATING):
        signal.signal(signum, signal.SIG_IGN)
