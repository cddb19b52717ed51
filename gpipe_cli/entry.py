"""The `gpipe` command's entry point: it imports nothing heavy, so a Ctrl-C while the rest loads is one line too."""

from __future__ import annotations

import sys

from gpipe_cli import interrupts


def main() -> None:
    """Load the command line and run it."""
    interrupts.stop_on_sigterm()
    try:
        from gpipe_cli.cli import main as run_command_line

        run_command_line()
    except KeyboardInterrupt:  # while loading or building the command line; each command speaks for itself
        print("gpipe: interrupted; nothing was written", file=sys.stderr)
        raise SystemExit(interrupts.exit_code(130)) from None
