"""A long command's phases said as they start, each with its estimate, and at the end what it all took."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpipe_cli.units import clock, human_seconds

# A phase expected to take less than this is said without an estimate: nobody waits on it.
SAY_BELOW_S = 2.0


def note(started: float, text: str) -> str:
    """A progress line with the seconds since the command started (`time.time()`): "[  3.2 s] reading data"."""
    return f"[{time.time() - started:5.1f} s] {text}"


def phase_line(what: str, seconds: float) -> str:
    """`what`, with its estimate when it is worth waiting on, e.g. "measuring K=2 (about 9 s)..."."""
    about = f" (about {human_seconds(seconds)})" if seconds >= SAY_BELOW_S else ""
    return f"{what}{about}..."


def took_line(elapsed: float, estimated: float) -> str:
    """e.g. "took 35 s (estimated 30 s)", both in one unit."""
    scale = max(elapsed, estimated)
    return f"took {human_seconds(elapsed, scale)} (estimated {human_seconds(estimated, scale)})"


@contextlib.contextmanager
def said_if_slow(say: Callable[[str], None], what: str, after: float) -> Iterator[None]:
    """Say `what` once the block has run `after` seconds: a wait that is mostly short is explained when it is not."""
    timer = threading.Timer(after, say, [f"{what}..."])
    timer.daemon = True  # never keeps an interrupted command alive
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class Progress:
    """Says each phase with its estimate, and keeps the start and the total estimate for the last line."""

    def __init__(self, say: Callable[[str], None], estimated: float = 0.0,
                 clock_s: Callable[[], float] = time.perf_counter) -> None:
        self.say, self._clock = say, clock_s  # a line as this command prints its phases
        self.started = clock_s()
        self.estimated = estimated  # the whole command's; phases added with `add` count towards it
        self._open: tuple[float, float] | None = None  # the phase under way: its start and its own estimate
        self._spent = self._planned = 0.0               # finished phases: seconds taken, seconds estimated

    def pace(self) -> float:
        """How much slower than estimated the finished phases ran (1.0 until one has; within 1/4 to 8)."""
        if self._planned < MIN_PACED_S:
            return 1.0
        return min(max(self._spent / self._planned, 0.25), 8.0)

    def phase(self, what: str, seconds: float, add: bool = False) -> None:
        """Say that `what` starts and about how long it takes (`add`: its estimate is part of the total)."""
        self.done()
        said = seconds * self.pace()
        if add:  # the total is what the lines said, so the last line compares with what was promised
            self.estimated += said
        self.say(phase_line(what, said))
        self._open = (self._clock(), seconds)

    def done(self) -> None:
        """The phase under way is over (the next one's start, or the end, says so too)."""
        if self._open is not None:
            start, seconds = self._open
            self._spent += self._clock() - start
            self._planned += seconds
            self._open = None

    def elapsed(self) -> float:
        """Seconds since the command started."""
        return self._clock() - self.started

    def took(self) -> str:
        """The last line: what it took beside what was estimated."""
        self.done()
        return took_line(self.elapsed(), self.estimated)


# Phases estimated at less than this in all are too short to judge the machine's pace by.
MIN_PACED_S = 1.0


@dataclass
class StepMean:
    """Step times seen so far, as their sum and count: a run's ETA costs the same at its millionth step."""

    seconds: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1

    def eta(self, done: int, total: int) -> float | None:
        """Seconds left of a run of `total` steps after `done`, at the mean step time (None before any)."""
        return max(total - done, 0) * self.seconds / self.count if self.count else None


def eta_text(seconds: float | None) -> str:
    """e.g. "eta 1m23s" ('' when not known yet)."""
    return "" if seconds is None else f"eta {clock(seconds)}"
