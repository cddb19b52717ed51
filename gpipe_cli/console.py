"""The console a command prints to: the terminal's, or in a file or a pipe one wide enough to keep rows whole."""

from __future__ import annotations

from rich.console import Console

FILE_WIDTH = 200  # columns when no terminal sets them: a log keeps each table row and line on one line


def output_console(least: int = 0) -> Console:
    """The terminal's console; elsewhere one of at least FILE_WIDTH (or `least`) columns that wraps no line."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=max(console.width, FILE_WIDTH, least), soft_wrap=True)
