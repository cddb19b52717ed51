"""When one stage fails, end every rank quickly and show the original error and the stage.

The failing rank prints its traceback and a one-line summary, writes that summary to an abort key in
the job's TCP store, and exits. A daemon thread on every rank watches the key (through a store
connection of its own, so it never contends with the compute thread) and exits its process as soon
as the key appears, even while the compute thread is blocked in a receive.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")
_KEY_PREFIX = "gpipe/abort/"
EXIT_CODE = 1


def _abort_key() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_KEY_PREFIX}{run}/{attempt}"


def _connect() -> dist.Store | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30),
                             wait_for_workers=False)
    except Exception:  # no store to watch: the launcher's own failure handling still applies
        return None


def _encode(summary: str, user_error: bool) -> str:
    # Who reported (so a rank knows whether it was first) and whether it was bad input.
    return f"{os.getpid()}@{socket.gethostname()}\n{int(user_error)}\n{summary}"


def _decode(text: str) -> tuple[str, bool]:
    parts = text.split("\n", 2)
    return (parts[2], parts[1] == "1") if len(parts) == 3 else (text, False)


class AbortWatch:
    """Exits this process when another rank reports a failure."""

    def __init__(self, label: str, poll: float = 0.5) -> None:
        self.label, self.poll = label, poll
        self._store = _connect()
        self._reporter = _connect()
        self._stopped = threading.Event()
        if self._store is not None:
            threading.Thread(target=self._watch, name="abort-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop watching (a clean shutdown)."""
        self._stopped.set()

    def report(self, summary: str, user_error: bool = False) -> tuple[bool, str, bool]:
        """Tell every rank to stop because of `summary`.

        Returns whether this rank reported first, and the first report's message and kind. The first
        report wins, so a rank that fails only because a peer vanished cannot hide the cause.
        """
        mine = _encode(summary, user_error)
        if self._reporter is None:
            return True, summary, user_error
        with contextlib.suppress(Exception):  # the store may already be gone; exiting matters more
            first = self._reporter.compare_set(_abort_key(), "", mine)
            text = first.decode(errors="replace") if isinstance(first, bytes) else str(first)
            return (text == mine, *_decode(text))
        return True, summary, user_error

    def _watch(self) -> None:
        key = _abort_key()
        while not self._stopped.wait(self.poll):
            try:
                if self._store is not None and self._store.check([key]):
                    message, user_error = _decode(self._store.get(key).decode(errors="replace"))
                    if not self._stopped.is_set():
                        if not user_error:  # bad input is shown once, by the rank that found it
                            print(f"[gpipe] {self.label} stopped: {message}", file=sys.stderr, flush=True)
                        os._exit(2 if user_error else EXIT_CODE)
            except Exception:
                if self._stopped.is_set():
                    return
                # The store is gone: the job's launcher or its first rank ended, so this rank must too.
                time.sleep(self.poll)
                print(f"[gpipe] {self.label} stopped: lost contact with the job", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)


def run_guarded(fn: Callable[[], T], label: str, watch: AbortWatch | None = None,
                quiet: tuple[type[BaseException], ...] = (), exit_code: int = EXIT_CODE) -> T:
    """Run `fn`; on an exception print it with `label`, stop every rank, and exit this one.

    Exceptions of the `quiet` types (bad user input) are shown as one line without a traceback.
    """
    try:
        return fn()
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        summary = str(exc) if isinstance(exc, quiet) else f"{label} failed: {type(exc).__name__}: {exc}"
        was_first, first, first_quiet = True, summary, isinstance(exc, quiet)
        if watch is not None:
            watch.stop()
            was_first, first, first_quiet = watch.report(summary, user_error=isinstance(exc, quiet))
        if not was_first:
            if not first_quiet and first != summary:  # a consequence of another rank's failure: name it
                print(f"[gpipe] {label} stopped: {first}", file=sys.stderr, flush=True)
            # bad input, or one error hit by several ranks, is shown once, by the rank that reported it
        elif isinstance(exc, quiet):
            print(f"error: {summary}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc(file=sys.stderr)
            print(f"[gpipe] {summary}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(getattr(exc, "exit_code", exit_code) if isinstance(exc, quiet) else 2 if first_quiet else exit_code)
