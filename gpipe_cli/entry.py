"""The `gpipe` command's entry point: it imports nothing heavy, so a Ctrl-C while the rest loads is one line too."""

from __future__ import annotations

import os
import signal


def _early(signum: int, frame: object) -> None:
    os.write(2, b"gpipe: interrupted; nothing was written\n")
    os._exit(128 + signum)


# First, before the rest of this module loads: a Ctrl-C there was a traceback (`interrupts` takes over below).
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _early)

from gpipe_cli import interrupts  # noqa: E402 (after the handler above)


def main() -> None:
    """Load the command line and run it."""
    import sys

    # A terminal or file whose encoding is not UTF-8 (latin-1, a C locale without coercion) took a spinner or a
    # translation's "…" as a UnicodeEncodeError traceback: a character it cannot show is written escaped.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    interrupts.stop_on_signals()
    try:
        from gpipe_cli.cli import main as run_command_line

        run_command_line()
    except KeyboardInterrupt:  # while loading or building the command line; each command speaks for itself
        _interrupted()
    except BaseException as exc:
        if isinstance(exc, SystemExit | GeneratorExit) or not interrupts.interrupted():
            raise
        _interrupted()  # a library that was loading turned the Ctrl-C into an error of its own


def _interrupted() -> None:
    interrupts.say_stopped("gpipe")
    raise SystemExit(interrupts.exit_code(130)) from None
