"""The `gpipe` command's entry point: it imports nothing, so a Ctrl-C while the rest loads is one line too."""

from __future__ import annotations

import sys


def main() -> None:
    """Load the command line and run it."""
    try:
        from gpipe_cli.cli import main as run_command_line
    except KeyboardInterrupt:
        print("gpipe: interrupted; nothing was written", file=sys.stderr)
        raise SystemExit(130) from None
    run_command_line()
