"""The `gpipe` command's entry point: it imports nothing heavy, so a Ctrl-C while the rest loads is one line too."""

from __future__ import annotations

from gpipe_cli import interrupts


def main() -> None:
    """Load the command line and run it."""
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
