"""Start a `gpipe` command, wait until it is measuring, send it Ctrl-C, and collect how it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


def as_from_a_terminal() -> None:
    """For `preexec_fn`: start a command with Ctrl-C and SIGHUP at their defaults, as a terminal starts it."""
    # A suite started in the background (`cmd &` from a script) inherits SIGINT ignored, and Python then
    # never turns it into KeyboardInterrupt; one under `nohup` inherits SIGHUP ignored: the command must start as
    # a terminal would start it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP})  # a test's launch may block them


def interrupt(args: list[str], tmp: Path, measuring: Callable[[Path, str], bool],
              timeout: float = 300, signum: int = signal.SIGINT) -> tuple[int, str, str]:
    """Run `gpipe *args` (temporary files under `tmp`), send `signum` once `measuring(tmp, output)`: code, out, err."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "gpipe_cli.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=as_from_a_terminal)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if measuring(tmp, "".join(out) + "".join(err)):
            proc.send_signal(signum)
            break
        time.sleep(0.2)
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    for reader in readers:
        reader.join(timeout=10)
    return proc.returncode, "".join(out), "".join(err)
