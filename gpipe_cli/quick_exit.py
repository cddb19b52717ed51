"""Leaving a process that imported torch without tearing its modules down."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

_RETURN_SUCCESS = False  # set in a rank forked by the launcher: success returns to its caller instead


def returning_success() -> None:
    """From now on `exit_now(0)` raises SystemExit(0) after its work, so that the process's caller sees it end."""
    global _RETURN_SUCCESS
    _RETURN_SUCCESS = True


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
    if code == 0 and _RETURN_SUCCESS:
        raise SystemExit(0)
    os._exit(code)
