"""When one stage fails, end every rank quickly and show the original error and the stage."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from gpipe_cli.pipeline import stopping
from gpipe_cli.pipeline.streams import stdout_refused

T = TypeVar("T")
_KEY_PREFIX = "gpipe/abort/"
EXIT_CODE = 1
# A rank ended because the job's failure was already told in one line (a stall): the launcher adds nothing.
ANNOUNCED = 4
# Left beside the announcing rank's error file: a rank it then kills (a stopped one) is the cause already told,
# whichever of the two ends first (the launcher hears of one failure only).
TOLD = "told"
POLL_S = 0.5  # how often a rank looks for another rank's report
PEER_GRACE_S = 5.0  # how long a rank whose peer vanished waits for the launcher to end it
# What gloo says when the rank at the other end of a connection is gone.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET", "EPIPE",
              "Connection refused")


def _timed_out(exc: BaseException) -> bool:
    """Whether `exc` is a receive or collective that ran past the transport's timeout (gloo's, NCCL's watchdog)."""
    return isinstance(exc, TimeoutError) or (isinstance(exc, RuntimeError) and "timed out" in str(exc).lower())


def _first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message ('' when it has none)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def job_key(prefix: str) -> str:
    """A store key of this attempt of the job, under `prefix`."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    return f"{prefix}{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def connect() -> dist.Store | None:
    """A connection of its own to the job's TCP store (None when there is no store to reach)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        # A store gone (node 0 refused the job and ended): a plain socket finds out at once, where c10d tries for
        # 30 s and logs each try with its C++ frames.
        socket.create_connection((addr, int(port)), timeout=5.0).close()
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30),
                             wait_for_workers=False)
    except Exception:  # no store to watch: the launcher's own failure handling still applies
        return None


_FAILED, _BAD_INPUT, _ANNOUNCED, _STOPPED = "0", "1", "2", "3"
STORE_TIMEOUT_S = 5.0  # the most a launcher waits on the job's store to tell or take back a stop


def mark_told() -> None:
    """Leave the mark that this rank told the job's failure in one line, so that the launcher adds none."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            open(os.path.join(os.path.dirname(error_file), TOLD), "w").close()


def _launch_store(endpoint: str) -> dist.Store:
    """A short-lived connection to the job's store at `endpoint` (the rendezvous's: the ranks' MASTER_ADDR:PORT)."""
    host, _, port = endpoint.rpartition(":")
    # A store not up yet: a plain socket finds out without c10d's log of a failed connection.
    socket.create_connection((host, int(port)), timeout=1.0).close()
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)


def _stopped_line(who: str) -> str:
    return f"{who} was stopped before the first step"


def _briefly(work: Callable[[], object]) -> None:
    """Run best-effort work on the job's store for at most STORE_TIMEOUT_S, its errors passed over."""
    def attempt() -> None:
        with contextlib.suppress(Exception):
            work()

    # In a thread: another program on the endpoint's port holds c10d's handshake, which heeds no timeout, for good.
    worker = threading.Thread(target=attempt, name="job-store", daemon=True)
    worker.start()
    worker.join(STORE_TIMEOUT_S)


def tell_stopped(endpoint: str, run_id: str, who: str) -> None:
    """Tell the ranks of a job over several nodes, through its store at `endpoint`, that `who` stopped (best effort)."""
    # A node stopped while its ranks start: they may not have reached their own report, and the other nodes'
    # ranks wait for them to connect.
    _briefly(lambda: _launch_store(endpoint).compare_set(
        f"{_KEY_PREFIX}{run_id}/0", "", f"{os.getpid()}@{socket.gethostname()}\n{_STOPPED}\n{_stopped_line(who)}"))


def clear_stopped(endpoint: str, run_id: str, who: str) -> None:
    """Take back a stop that `who` told the job's store at `endpoint` on an earlier start (best effort)."""
    # A node stopped while waiting for a third leaves its report in the store on node 0; started again, it would
    # form the job and every rank would end at once for a stop that is over. Only its own report is taken back.
    def clear() -> None:
        store, key = _launch_store(endpoint), f"{_KEY_PREFIX}{run_id}/0"
        if store.check([key]):
            text = store.get(key).decode(errors="replace")
            message, kind, _ = _decode(text)
            if kind == _STOPPED and message == _stopped_line(who):
                store.compare_set(key, text, "")  # "" is no report: a later one still takes its place

    _briefly(clear)


def _elsewhere(origin: str) -> bool:
    """Whether a report's origin (pid@host) is a rank on another host, whose terminal is not this node's."""
    return origin.partition("@")[2] not in ("", socket.gethostname())


def _decode(text: str) -> tuple[str, str, str]:
    parts = text.split("\n", 2)
    return (parts[2], parts[1], parts[0]) if len(parts) == 3 else (text, _FAILED, "")


# The failing rank writes its summary to an abort key in the job's store. A daemon thread on every rank watches
# the key through a store connection of its own (never contending with the compute thread) and exits its
# process once the key appears, even while the compute thread is blocked in a receive.
class AbortWatch:
    """Exits this process when another rank reports a failure."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._store = connect()
        self._reporter = connect()
        self._stopped = threading.Event()
        if self._store is not None:
            threading.Thread(target=self._watch, name="abort-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop watching (a clean shutdown)."""
        self._stopped.set()

    def announce(self, summary: str) -> bool:
        """Stop every rank because of `summary`, printed once for the whole job; returns whether this was first."""
        first, _, _, _ = self.report(summary, _ANNOUNCED)
        if first:
            mark_told()
            print(f"[gpipe] {summary}", file=sys.stderr, flush=True)
        return first

    def stopped(self) -> None:
        """Tell the ranks of the other nodes that this one was stopped before its first step (they wait for it)."""
        self.report(f"rank {os.environ.get('RANK', '?')} on {socket.gethostname()} was stopped before the first "
                    "step", _STOPPED)

    def report(self, summary: str, kind: str = _FAILED) -> tuple[bool, str, str, str]:
        """Tell every rank to stop for `summary`: whether this rank was first; the first's message, kind, origin."""
        # The first wins, so a rank failing because a peer vanished cannot hide the cause. A bad-input report's
        # kind carries the exit code of the other ranks.
        # Who reported (so a rank knows whether it was first, and on which host) and what kind of report.
        mine = f"{os.getpid()}@{socket.gethostname()}\n{kind}\n{summary}"
        if self._reporter is None:
            return True, summary, kind, ""
        with contextlib.suppress(Exception):  # the store may already be gone; exiting matters more
            first = self._reporter.compare_set(job_key(_KEY_PREFIX), "", mine)
            text = first.decode(errors="replace") if isinstance(first, bytes) else str(first)
            message, first_kind, origin = _decode(text)
            return text == mine, message, first_kind, origin
        return True, summary, kind, ""

    def _watch(self) -> None:
        key = job_key(_KEY_PREFIX)
        while not self._stopped.wait(POLL_S):
            try:
                text = self._store.get(key) if self._store is not None and self._store.check([key]) else b""
                if text:  # empty: none, or one a node took back when it started again (`clear_stopped`)
                    message, kind, origin = _decode(text.decode(errors="replace"))
                    if origin.startswith(f"{os.getpid()}@") or kind == _STOPPED and stopping.received():
                        continue  # this rank's own report, or a stop it got too: it ends itself once done
                    if not self._stopped.is_set():
                        # Bad input and announced stalls are shown once, by the rank that found them (or
                        # here too when that rank runs on another host, whose terminal this is not).
                        elsewhere = _elsewhere(origin)
                        # A node's stop is news on every node, said once by each.
                        node_speaker = kind == _STOPPED and os.environ.get("LOCAL_RANK", "0") == "0"
                        if kind == _FAILED or node_speaker or elsewhere and kind != _STOPPED:
                            print(f"[gpipe] {self.label} stopped: {message}", file=sys.stderr, flush=True)
                        kind, _, code = kind.partition(":")
                        stopping.abrupt_exit(int(code) if code.isdigit() else
                                 {_BAD_INPUT: 2, _ANNOUNCED: ANNOUNCED}.get(kind, EXIT_CODE))
            except Exception:
                if self._stopped.is_set():
                    return
                # The store is gone: the job's launcher or its first rank ended, so this rank must too.
                time.sleep(POLL_S)
                print(f"[gpipe] {self.label} stopped: lost contact with the job", file=sys.stderr, flush=True)
                stopping.abrupt_exit(EXIT_CODE)


def run_guarded(fn: Callable[[], T], label: str, watch: AbortWatch | None = None,
                quiet: tuple[type[BaseException], ...] = ()) -> T:
    """Run `fn`; on an exception print it with `label`, stop every rank, and exit this one."""
    try:
        return fn()
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None) or isinstance(exc, stopping.StoppedEarly):
            raise
        if stopping.ending():  # e.g. sentencepiece's training turns the StoppedEarly of its callback into an error
            raise stopping.StoppedEarly(stopping.ending()) from None
        if any(marker in str(exc) for marker in _PEER_LOST):  # another rank's process is gone
            # The launcher ends every rank and names the one that died; this rank would print a consequence as the
            # cause: it gives the launcher a moment to end it quietly.
            if stopping.received():  # already asked to stop: this is the tear-down
                stopping.abrupt_exit(128 + stopping.received())
            with contextlib.suppress(ValueError):  # only the main thread may set handlers
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(PEER_GRACE_S)
            # gloo goes on after the peer's address: "This is typically caused by a remote worker crashing ... GLHF!"
            gist = _first_line(exc).split(". This is typically", 1)[0]
            print(f"[gpipe] {label} lost contact with another rank: {type(exc).__name__}: {gist}",
                  file=sys.stderr, flush=True)
            if watch is not None:
                watch.stop()
                watch.report(f"{label} lost contact with another rank")
            stopping.abrupt_exit(EXIT_CODE)
        user_error = isinstance(exc, quiet)  # bad user input: one line, no traceback
        summary = str(exc) if user_error else f"{label} failed: {type(exc).__name__}: {exc}"
        timed_out = not user_error and _timed_out(exc)
        if timed_out:  # a peer stopped or frozen: the wait is the news, not where this rank waited
            gist = _first_line(exc).rsplit("] ", 1)[-1]  # gloo leads with its source file's path
            summary = (f"{label} gave up waiting for another rank, which is stopped, frozen or unreachable: "
                       f"{type(exc).__name__}: {gist}")
        # A log on a full disk, or a wait given up, is told by this rank in one line: the others end without a word.
        kind = f"{_BAD_INPUT}:{getattr(exc, 'exit_code', 2)}" if user_error else \
            _ANNOUNCED if stdout_refused(exc) or timed_out else _FAILED
        was_first, first, first_kind, origin = True, summary, kind, ""
        if watch is not None:
            watch.stop()
            was_first, first, first_kind, origin = watch.report(summary, kind)
        first_quiet = first_kind.startswith(_BAD_INPUT)
        if not was_first:
            if first_kind != _ANNOUNCED and not first_quiet and first != summary:  # a consequence: name it
                print(f"[gpipe] {label} stopped: {first}", file=sys.stderr, flush=True)
            elif first_quiet and _elsewhere(origin) and os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"error: {first}", file=sys.stderr, flush=True)  # once on each other node's terminal too
            # bad input, or one error hit by several ranks, is shown once, by the rank that reported it
        elif user_error:
            print(f"error: {summary}", file=sys.stderr, flush=True)
        elif stdout_refused(exc):  # a log on a full disk: the disk is the news, not where the line was printed
            mark_told()
            why = getattr(exc, "strerror", exc)
            print(f"[gpipe] {label} stopped: cannot write to standard output ({why}); the run ends at its last "
                  "checkpoint", file=sys.stderr, flush=True)
        elif timed_out:
            mark_told()
            print(f"[gpipe] {summary}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc(file=sys.stderr)
            print(f"[gpipe] {summary}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError, ValueError):  # standard output may be what failed
            sys.stdout.flush()
        stopping.abrupt_exit(getattr(exc, "exit_code", EXIT_CODE) if user_error else 2 if first_quiet else EXIT_CODE)
