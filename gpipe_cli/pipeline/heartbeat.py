"""Stall detection: every rank beats through the job's store; a silent or stuck rank is named and the job ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from gpipe_cli.pipeline import failure, stopping

INTERVAL_S = 1.0
STOPPED_GAP_S = 5 * INTERVAL_S  # a judge that looked no sooner (nor within a quarter of its limit) was stopped
FLOOR_S = 60.0
SLOWEST_FACTOR = 10.0
RECENT_STEPS = 100  # the default limit follows the slowest of these, so one long pause raises it only for a while
_KEY_PREFIX = "gpipe/beat/"

# This process's progress, written by the compute thread and read by the heartbeat thread.
_steps = 0
_current = 0  # the step the host works on: reading or launching it, or waiting for its figures (0: not said;
# -N: the evaluation after step N)
_evaluated = 0  # held-out batches and decoding steps finished: progress between training steps
_slowest = 0.0  # of the last RECENT_STEPS steps
_recent: deque[float] = deque(maxlen=RECENT_STEPS)
_paused = 0
_started = False
_on_start: Callable[[], object] | None = None  # beats at once when training starts (set by Heartbeat)


class Waits:
    """What this rank waits for: host waits in progress, and device waits the device has not passed yet."""

    _KEEP = 4096  # device waits remembered; older ones count as finished

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = 0
        self._host: str | None = None
        self._device: deque[tuple[Any, str]] = deque()

    @contextlib.contextmanager
    def host(self, what: str) -> Iterator[None]:
        """The host blocks in this block, waiting for `what`."""
        self._host = what
        try:
            yield
        finally:
            self._host = None
            with self._lock:
                self._done += 1

    def device(self, event: Any, what: str) -> None:
        """The device waits for `what` until it passes `event` (recorded just after the wait)."""
        with self._lock:
            self._device.append((event, what))
            if len(self._device) > self._KEEP:
                self._device.popleft()
                self._done += 1

    def poll(self) -> tuple[int, str | None]:
        """Waits finished so far, and the oldest one still pending (host first), if any."""
        with self._lock:
            while self._device and self._device[0][0].query():
                self._device.popleft()
                self._done += 1
            pending = self._host or (self._device[0][1] if self._device else None)
            return self._done, pending


waits = Waits()


def step_done(seconds: float) -> None:
    """Note progress: a training step finished, after `seconds`."""
    global _steps, _slowest
    _steps += 1
    _recent.append(seconds)
    _slowest = max(_recent)


def evaluated() -> None:
    """Note progress outside a step: a held-out batch, or one decoding step, is done."""
    global _evaluated
    _evaluated += 1


def progress(transfers: int) -> int:
    """This rank's progress as beaten: steps, waits and evaluation work finished."""
    return _steps + transfers + _evaluated


@contextlib.contextmanager
def evaluating(step: int) -> Iterator[None]:
    """The host evaluates the model trained to `step`: a stall meanwhile is said to be in that evaluation."""
    before = working_on(-step)
    try:
        yield
    finally:
        working_on(before)


def working_on(step: int) -> int:
    """Note the step the host works on now (counted from 1; -N: evaluates after step N); returns the one before."""
    global _current
    before, _current = _current, step
    return before


def training_started() -> None:
    """Note that set-up is over on this rank: the first step begins."""
    global _started
    _started = True
    if _on_start is not None:
        # At once, from this thread: a rank stopped right after starting must be judged as started.
        with contextlib.suppress(Exception):  # the store is gone: the abort watch ends this rank
            _on_start()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Long work between steps (a checkpoint write): progress is not judged meanwhile."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def default_timeout(slowest_step: float) -> float:
    """The stall timeout when none is set: the larger of 60 s and 10x the slowest recent step."""
    return max(FLOOR_S, SLOWEST_FACTOR * slowest_step)


@dataclass(frozen=True)
class Beat:
    """One rank's latest beat as stored."""

    count: int
    progress: int
    steps: int
    slowest: float
    paused: bool
    pid: int
    host: str
    started: bool = False  # set-up is over: the rank is in its first step or later
    waiting: str | None = None  # what the rank (or its device) waits for, if anything
    current: int = 0  # the step its host works on (0: not said)

    def encode(self) -> str:
        """The stored form."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def decode(text: str) -> Beat:
        """Parse the stored form."""
        return Beat(**json.loads(text))


class Judge:
    """Decides, from successive views of every rank's beat, whether the job has stalled (pure: no store)."""

    def __init__(self, rank: int, timeout: float | None, name: Callable[[int], str]) -> None:
        self.rank, self.timeout, self.name = rank, timeout, name
        self._heard: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it last changed)
        self._progress: tuple[tuple[int, ...], float] | None = None
        self._looked: float | None = None

    def verdict(self, beats: list[Beat], now: float) -> tuple[str, list[int]] | None:
        """None, or why the job stalled and which ranks are to blame."""
        limit = self.timeout if self.timeout is not None else default_timeout(max(b.slowest for b in beats))
        # A gap in this judge's own looks: it was stopped too (the whole job suspended, then continued), and the
        # others have had no time to beat since. Every clock starts again; it ended such a job at once.
        if self._looked is not None and now - self._looked > max(STOPPED_GAP_S, limit / 4):
            self._heard = {rank: (count, now) for rank, (count, _) in self._heard.items()}
            self._progress = None
        self._looked = now
        for rank, beat in enumerate(beats):
            if rank != self.rank and self._heard.get(rank, (None, 0.0))[0] != beat.count:
                self._heard[rank] = (beat.count, now)
        # Set-up (tokenizer training in C++) and checkpoint writes may hold the interpreter lock for long
        # stretches, starving the beating thread: silence is judged only in training and between writes.
        silent = [r for r, (_, since) in self._heard.items()
                  if now - since > limit and beats[r].started and not beats[r].paused]
        if silent:
            names = ", ".join(self.name(r) for r in silent)
            return (f"{names} stopped responding: no heartbeat for {limit:.0f} s (the process is stopped or "
                    f"frozen); ending the job", silent)
        # Before every rank finished a step only a fixed timeout is judged, from when all started training: the
        # default grows with the slowest step, which is not known yet (a big model's first step is long).
        early = any(b.steps < 1 for b in beats)
        if any(b.paused for b in beats) or (early and (self.timeout is None or not all(b.started for b in beats))):
            self._progress = None
            return None
        state = tuple(b.progress for b in beats)
        if self._progress is None or self._progress[0] != state:
            self._progress = (state, now)
            return None
        if now - self._progress[1] <= limit:
            return None
        fewest = min(b.steps for b in beats)
        behind = [r for r, b in enumerate(beats) if b.steps == fewest]
        names = ", ".join(self.name(r) + (f" ({beats[r].waiting})" if beats[r].waiting else "") for r in behind)
        # A step is finished once its figures are read, after the next one is launched: the step the hosts work
        # on is said where they say it, as their steps finished would name the one before.
        step = min((beats[r].current for r in behind if beats[r].current), default=fewest + 1)
        where = f"step {step}" if step > 0 else f"the evaluation after step {-step}"
        return (f"no progress for {limit:.0f} s: {names} stuck in {where} (still running, but no step, transfer "
                f"or held-out batch finished); ending the job (steps this slow on purpose: raise "
                f"train.stall_timeout)", behind)


class Heartbeat:
    """Beats for this rank and ends the job when any rank stalls."""

    def __init__(self, watch: failure.AbortWatch, rank: int, world: int, timeout: float | None,
                 name: Callable[[int], str]) -> None:
        self.watch, self.rank = watch, rank
        self.judge = Judge(rank, timeout, name)
        self._keys = [f"{failure.job_key(_KEY_PREFIX)}/{r}" for r in range(world)]
        self._store = failure.connect()
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # the compute thread beats once too (training_started)
        self._count = 0
        if self._store is not None:
            global _on_start
            # The first beat now, from this thread: the beating thread may be starved while set-up holds
            # the interpreter lock, and a rank without a beat cannot be judged.
            with contextlib.suppress(Exception):
                self._send()
            _on_start = self._send
            threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def stop(self) -> None:
        """Stop beating and judging (a clean shutdown)."""
        global _on_start
        self._stopped.set()
        _on_start = None

    def _send(self, read: bool = False) -> list[Beat] | None:
        """Write this rank's beat (raises if the store is gone); with `read`, everyone's (None until all beat)."""
        assert self._store is not None
        with self._lock:
            self._count += 1
            transfers, waiting = waits.poll()
            mine = Beat(self._count, progress(transfers), _steps, _slowest, _paused > 0, os.getpid(),
                        socket.gethostname(), _started, waiting, _current)
            self._store.set(self._keys[self.rank], mine.encode())
            if not read or not self._store.check(self._keys):
                return None
            return [Beat.decode(v.decode()) for v in self._store.multi_get(self._keys)]

    def _beat(self) -> None:
        while not self._stopped.wait(INTERVAL_S):
            try:
                beats = self._send(read=True)
                if beats is None:
                    continue  # not every rank beats yet
            except Exception:
                return  # the store is gone: the abort watch ends this rank
            found = self.judge.verdict(beats, time.monotonic())
            if found is not None and not self._stopped.is_set():
                self._end(found[0], [beats[r] for r in found[1]])

    def _end(self, message: str, culprits: list[Beat]) -> None:
        if self.watch.announce(message):
            # A stopped process would never end on the launcher's SIGTERM: end the ones on this host now.
            for beat in culprits:
                if beat.host == socket.gethostname() and beat.pid != os.getpid():
                    with contextlib.suppress(OSError):
                        os.kill(beat.pid, signal.SIGKILL)
        stopping.abrupt_exit(failure.ANNOUNCED)
