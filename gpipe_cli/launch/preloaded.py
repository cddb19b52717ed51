"""Imported last by the rank server: its import says that the server holds what every rank imports (see `forked`)."""

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from gpipe_cli.launch.forked import JOB_SIGNALS, LAUNCHER

Hook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def quiet_orphans(previous: Hook) -> Hook:
    """`previous`, less the traceback of a rank whose launcher went away before handing it its work."""
    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> Any:
        # A stop while the ranks start: the fork reads its work from a pipe the launcher closed (EOFError in
        # multiprocessing's spawn._main), and the server's child printed that traceback under the stop's one line.
        frames = traceback.extract_tb(tb)
        if issubclass(kind, EOFError) and any(f.name == "_main" and f.filename.endswith(os.path.join(
                "multiprocessing", "spawn.py")) for f in frames):
            return None
        return previous(kind, value, tb)
    return hook


def die_with_launcher() -> None:
    """Have the kernel end this server with the launcher that started it; torch then stops the server's ranks."""
    # A launcher killed outright (SIGKILL) left the server, and so its ranks, running: a node's rank trained on as
    # an orphan, then waited for good for the launcher to take its result. Each rank stops on SIGINT when its
    # parent, the server, ends (torch's multiprocessing asks the kernel for that).
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if str(os.getppid()) != os.environ.get(LAUNCHER, str(os.getppid())):  # it ended before the kernel was asked
        os._exit(1)


if (_marker := os.environ.get("GPIPE_PRELOADED")) is not None:
    die_with_launcher()
    sys.excepthook = quiet_orphans(sys.excepthook)
    # Blocked in the server since its first instruction, the job's signals are ignored too from here on, and so in
    # what it forks, until a child takes them back (`forked.run`); one pending is dropped: it is the launcher's.
    for _signum in JOB_SIGNALS:
        signal.signal(_signum, signal.SIG_IGN)
    # A stop while the server loads: the command has ended and taken its folder along, and none waits for the mark.
    with contextlib.suppress(OSError), open(f"{_marker}-{os.getpid()}", "w"):
        pass
