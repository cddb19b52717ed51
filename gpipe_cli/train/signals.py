"""Ctrl-C, SIGTERM and SIGHUP: finish the current step, write a checkpoint, stop every rank cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from gpipe_cli.pipeline import stopping

# The host launches a step before it reads the one before: a stop waits for both. An evaluation says otherwise.
AFTER_STEP = "after the steps in flight"
# A SIGINT this soon after the first is the same Ctrl-C come twice: a wrapper in the terminal's process group
# (`timeout`, a scheduler's step) passes on the one the terminal also sent the launcher, which forwards both.
ECHO_S = 1.0


def answers_stops(rank: int) -> bool:
    """Whether this rank answers a stop signal in words: rank 0, and the first rank of every other node."""
    # A Ctrl-C on node 1 of a job was met with silence there: only rank 0, on node 0, spoke.
    return rank == 0 or os.environ.get("LOCAL_RANK") == "0"


class StopRequest:
    """Remembers the first stop signal this rank received."""

    def __init__(self, announce: bool) -> None:
        self.signum = 0
        self.since = 0.0  # when the first stop signal came (time.monotonic)
        self.announce = announce
        self.parent = os.getppid()  # a rank's parent ending sends it SIGINT (torch's workers ask for it)
        self.when = AFTER_STEP  # what a stop signal cuts short, as the answer to Ctrl-C says
        self.echo = False  # the stop came as the launcher's note: its signal, if it comes, is no second stop
        self.orphaned = False  # the first stop was the SIGINT a rank gets as its launcher ends (kill -9 of it)
        self.way_on: Callable[[], str] = lambda: ""  # how the run goes on after an abort, said with it
        self._watched = False
        # Re-entrant: the answer's line, written to a closed output, stops the run through `_direct` in turn.
        self._lock = threading.RLock()
        self._done: int | None = None  # once disarmed: the code a stop signal ends the rank with (0: 128 + it)

    def arm(self) -> None:
        """Take over the stop signals from the set-up's handler (after the first step: before it, nothing to save)."""
        for sig in stopping.STOPS:
            signal.signal(sig, self._direct)
        # A stop the launcher saw through while this rank set up, whose signal never came: the rank forked after
        # the launcher last looked for ranks, and reached its first step before it looked again. Heeded as sent;
        # the signal may yet come, as the same stop.
        if not self.signum and (signum := stopping.asked()):
            self._handle(signum, None)
            self.echo = True
        stopping.started()
        self._watch()

    def _watch(self) -> None:
        """Answer each stop signal in a thread of its own, even while the main thread waits for a peer."""
        # Python runs a handler only between the main thread's bytecodes: held in a wait for a stopped or stuck peer,
        # it left Ctrl-C unanswered, and a second one could not abort, until the stall timeout ended the job. Each
        # signal also goes to a pipe (from C), read here.
        if self._watched:
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)
        threading.Thread(target=self._read, args=(read,), name="stop-signals", daemon=True).start()
        self._watched = True  # only now does `_direct` leave stop signals to the thread: none is lost meanwhile

    def _direct(self, signum: int, frame: FrameType | None) -> None:
        """The handler Python runs: stop signals are the `_watch` thread's; a closed output's SIGPIPE is seen here."""
        if signum not in stopping.STOPS or not self._watched:  # (one seen by both within ECHO_S counts once)
            with self._lock:
                self._handle(signum, frame)

    def _read(self, read: int) -> None:
        while data := os.read(read, 1):
            if data[0] not in stopping.STOPS:
                continue
            with self._lock, contextlib.suppress(Exception):  # the thread lives on: a later stop is still seen
                if self._done is not None:
                    stopping.abrupt_exit(self._done or 128 + data[0])
                self._handle(data[0], None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        stopping.note(signum)
        if not self.signum:
            self.signum, self.since = signum, time.monotonic()
            self.orphaned = signum == signal.SIGINT and os.getppid() != self.parent
            if self.announce and signum == signal.SIGINT:  # a person pressed Ctrl-C: answer at once
                what = "the launcher ended (SIGINT)" if self.orphaned else "SIGINT"
                again = "" if self.orphaned else " (Ctrl-C again to abort at once)"
                stopping.say_stop(f"{what}: stopping {self.when}{again}")
        elif self.echo and signum == signal.SIGINT:  # a SIGTERM again changes nothing anyway
            self.echo = False
        elif signum == signal.SIGINT and time.monotonic() - self.since >= ECHO_S:
            if self.announce:
                then = self.way_on()
                print("[gpipe] SIGINT again: aborted at once; a checkpoint it cut short is removed on resume"
                      + (f"; {then}" if then else ""), file=sys.stderr, flush=True)
            stopping.abrupt_exit(128 + signum)

    def cause(self, signum: int) -> str:
        """What stopped the run, in words: the signal's name, or the launcher's end that sent it."""
        return "the launcher ended" if self.orphaned and signum == signal.SIGINT else signal.Signals(signum).name

    def disarm(self, code: int) -> None:
        """Once the run's work is done, a stop signal ends this rank at once, with exit `code` (0: 128 + the signal)."""
        # Else a rank waiting for its launcher to read its result would only note the signal, and the
        # launcher's tear-down would wait minutes for it. A run that ended otherwise keeps its own code: the
        # tear-down's SIGTERM after a peer ended is not news.
        with self._lock:
            self._done = code
        for sig in stopping.STOPS:
            signal.signal(sig, lambda signum, frame: stopping.abrupt_exit(code or 128 + signum))

    def agreed(self, group: dist.ProcessGroup | None, distributed: bool, say: bool = True) -> int:
        """The stop signal any rank received (0: none), the same on every rank; `say`: rank 0 says a save follows."""
        agreed = self.signum
        if distributed:
            flag = torch.tensor([self.signum], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            agreed = int(flag.item())
            self.signum = self.signum or agreed
        if agreed and self.announce and say:
            why = "the output was closed (SIGPIPE)" if agreed == signal.SIGPIPE else self.cause(agreed)
            print(f"[gpipe] {why}: writing a checkpoint, then stopping", file=sys.stderr, flush=True)
        return agreed
