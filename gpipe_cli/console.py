"""The console a command prints to: the terminal's, or in a file or a pipe one wide enough to keep rows whole."""

from __future__ import annotations

import re
import shutil
import textwrap
from collections.abc import Collection, Iterable
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

_NOTE = re.compile(r"\[\s*[\d.]+ s\] ")  # a timed note's prefix, "[  3.2 s] "
# A number and its unit stay on one line: the space between them is held by a mark no text contains.
UNITS = ("s", "ms", "us", "B", "KiB", "MiB", "GiB", "TiB", "GB/s", "samples/s", "tokens/s", "px", "%")
_UNIT_SPACE = re.compile(r"(?<=\d) (?=(?:" + "|".join(re.escape(u) for u in UNITS) + r")(?![\w/]))")
_HELD = "\0"
FILE_WIDTH = 200  # columns when no terminal sets them: a log keeps each table row and line on one line


def output_console(least: int = 0) -> Console:
    """The terminal's console; elsewhere one of at least FILE_WIDTH (or `least`) columns that wraps no line."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=max(console.width, FILE_WIDTH, least), soft_wrap=True)


def figure_table(title: str, columns: Iterable[str], left: Collection[str] = (), **settings: Any) -> Table:
    """A table of figures: its columns right-aligned but those named in `left` (`settings`: the Table's own)."""
    table = Table(title=title, **settings)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right")
    return table


def _hang(text: str) -> int:
    """Where a wrapped line's continuation starts: after a timed note's "[  3.2 s] ", else two in from its indent."""
    match = _NOTE.match(text)
    return match.end() if match else len(text) - len(text.lstrip(" ")) + 2


def fit(text: str, width: int) -> str:
    """`text` wrapped at spaces to `width` columns, continuation lines indented, never a number split from its unit."""
    if len(text) <= width:
        return text
    indent = " " * min(_hang(text), width // 2)
    held = _UNIT_SPACE.sub(_HELD, text)
    return textwrap.fill(held, width, subsequent_indent=indent, break_long_words=False,  # a long path stays whole
                         break_on_hyphens=False).replace(_HELD, " ")


def say(text: str, stream: TextIO) -> None:
    """Print a line: on a terminal wrapped at spaces to its width, elsewhere whole (a log keeps one line each)."""
    if stream.isatty():
        text = "\n".join(fit(line, shutil.get_terminal_size().columns) for line in text.split("\n"))
    print(text, file=stream, flush=True)
