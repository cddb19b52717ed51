"""Leaving a process that imported torch without tearing its modules down."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit as the interpreter would (threads joined, exit handlers run, output flushed), less the teardown."""
    # Tearing down torch, sympy and the rest takes about a second after every command, and a rank's
    # second comes before its launcher's. Everything this tool writes is closed before it gets here.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream has nothing left to flush
            stream.flush()
    os._exit(code)
