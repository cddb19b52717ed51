"""Ranks forked from one process that imported torch once, where each would import it again (seconds apiece)."""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing import forkserver, resource_tracker
from typing import TextIO

from gpipe_cli import quick_exit

START_METHOD = "forkserver"
# What the server imports before it forks the first rank: what every rank imports before its first step.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gpipe_cli.train.worker", "gpipe_cli.train.loop",
           "gpipe_cli.bench.worker", "gpipe_cli.bench.setup", "gpipe_cli.launch.preloaded"]
# Signals meant for the job's whole process group (a terminal's Ctrl-C, a scheduler's SIGTERM): blocked in the
# server from its first instruction, since the launcher reads each rank's exit code through it; each rank takes
# them back.
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
LAUNCHER = "GPIPE_LAUNCHER_PID"  # tells the server the process it is to end with
_ours: int | None = None  # the server `prepare` started: one started elsewhere in this process preloads other modules


def available() -> bool:
    """Whether ranks can fork from a preloaded server here: POSIX, a server this process can restart, a short path."""
    if START_METHOD not in multiprocessing.get_all_start_methods() or not hasattr(forkserver.ForkServer, "_stop"):
        return False
    # The server listens on a Unix socket in multiprocessing's folder, made on first use under the temporary
    # folder; not under one a caller made the default for a while (bench removes its own before this process ends).
    previous, tempfile.tempdir = tempfile.tempdir, None
    try:
        folder = multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = previous
    return len(os.path.join(folder, "listener-12345678").encode()) < 100  # a socket's path has at most 107 bytes


def prepare(fresh: bool = True) -> None:
    """Start a server, which imports torch while the launch sets up; `fresh`: not one started for an older launch."""
    global _ours
    # An older launch's server has that launch's environment; one this module did not start never says it preloaded.
    if fresh or (running() and _server() != _ours):
        stop()
    multiprocessing.set_forkserver_preload(PRELOAD)
    # It starts multiprocessing's resource tracker too, which the ranks share. A rank that fails ends with
    # os._exit, leaving it the semaphores `datasets` makes; it cleans them up and warns, two lines of noise after
    # the one that says what failed. Started with this filter, it keeps its other warnings.
    warnings = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), "ignore:resource_tracker:UserWarning")))
    # c10d's C++ warnings carry a stack of frames each: a job whose launcher vanished printed four pages of them
    # before its one line. A user's own level wins (e.g. INFO to debug a hang).
    level = os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")
    before = _server()
    # From the main thread only: the server ends with the thread that started it (see `preloaded`).
    with environment({"PYTHONWARNINGS": warnings, "TORCH_CPP_LOG_LEVEL": level, "GPIPE_PRELOADED": _marker(),
                      LAUNCHER: str(os.getpid())}):
        # First: it unblocks SIGINT and SIGTERM on its way out, but not SIGHUP, whose default would end it with the
        # job's process group (a closed terminal): eight tracebacks after the run's last line. It keeps this mask.
        hup = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGHUP,))
        try:
            resource_tracker.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, hup)
        # Blocked in this thread, which forks the server: a new program keeps its parent's mask, so the server
        # holds them from its first instruction (each rank unblocks them). Not ignored for the whole process: a
        # signal that this process's other threads took meanwhile was lost, and the command ran on to its end.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            forkserver.ensure_running()  # starts one, unless it is running
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if _server() != before:
        _ours = _server()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Within the block this process's environment holds `values`, which the processes it starts inherit; restored."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop(server: bool = True) -> None:
    """End anything the server forked that is left, and the server unless another launch forks from it."""
    forks = forkserver._forkserver
    pid = _server()
    if pid is not None:
        # A rank is left only when the launch ended early (a stop while it started); the server, still
        # importing torch then, would read its end only after.
        for child in [*children_of(pid), *([pid] if server else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    if server:
        forks._stop()  # type: ignore[attr-defined]
        if pid is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(_preloaded(pid))


def _server() -> int | None:
    """The pid of the server started for this process, if one is running."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _marker() -> str:
    """Where the server says it has imported PRELOAD: this, its pid appended (multiprocessing's folder is ours)."""
    return os.path.join(multiprocessing.util.get_temp_dir(), "gpipe-preloaded")


def _preloaded(pid: int) -> str:
    """The file that server `pid` makes once it has imported PRELOAD."""
    return f"{_marker()}-{pid}"


def wait_preloaded(timeout: float) -> None:
    """Return once the server has imported PRELOAD, it has ended, or `timeout` seconds have passed; Ctrl-C acts."""
    # A fork asked for meanwhile waits inside multiprocessing for those seconds of imports, where a caller that holds
    # Ctrl-C (to start its children whole) would hold it all along.
    pid = _server()
    if pid is None or pid != _ours:  # none, or one that would never say
        return
    deadline = time.monotonic() + timeout
    # Alive as /proc says (no /proc: no wait): reaping it here would leave multiprocessing a server it cannot reap.
    while pid in processes() and not os.path.exists(_preloaded(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)


def running() -> bool:
    """Whether a server has been started (and not stopped) for this process."""
    return _server() is not None


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every running process (none where there is no /proc)."""
    found = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] == "Z":  # ended, its exit code not yet read by its parent
                    continue
                found[int(entry)] = (int(fields[1]), int(fields[3]))
            except (OSError, IndexError, ValueError):
                continue
    return found


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [child for child, (parent, _) in processes().items() if parent == pid]


def run(module: str, args: list[str]) -> None:
    """Run `module.main(args)` in this forked rank as `python -u -m module *args` would run it."""
    os.setsid()  # a session of its own, as torchrun starts its ranks: a Ctrl-C comes from the launcher alone
    # Blocked since the server started: what came for the launcher's group while this rank forked is the launcher's
    # to pass on, dropped here (a pending signal set to be ignored is discarded), then each is taken back.
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in JOB_SIGNALS[1:]:
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:  # what `top` and `ps -o comm` show
        comm.write(f"gpipe rank {os.environ.get('RANK', '')}"[:15])
    sys.stdout = _unbuffered(1, sys.stdout)
    sys.stderr = _unbuffered(2, sys.stderr)
    quick_exit.returning_success()  # torch's wrapper counts a rank done only when its function returns
    try:
        importlib.import_module(module).main(args)
    except SystemExit as stop:
        if stop.code in (None, 0):
            return
        if not isinstance(stop.code, int):  # a message: printed, exit code 1, as Python does
            print(stop.code, file=sys.stderr)
        os._exit(stop.code if isinstance(stop.code, int) else 1)
    except KeyboardInterrupt:
        os._exit(128 + signal.SIGINT)
    except BaseException:  # as Python itself ends: torch's wrapper would only hand the traceback to a silent log
        traceback.print_exc()
        os._exit(1)


def _unbuffered(fd: int, stream: TextIO) -> TextIO:
    """A text stream on `fd` that writes each call through at once, as Python's -u does."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=stream.encoding, errors=stream.errors,
                            write_through=True)
