"""The console a command prints to: the terminal's, or in a file or a pipe one wide enough to keep rows whole."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import textwrap
from collections.abc import Collection, Iterable, Sequence
from typing import Any, TextIO

from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Column, Table
from rich.text import Text

from gpipe_cli.units import BYTE_UNITS

_NOTE = re.compile(r"\[\s*[\d.]+ s\] ")  # a timed note's prefix, "[  3.2 s] "
# A number and its unit stay on one line: the space between them is held by a mark no text contains.
UNITS = ("s", "ms", "us", *BYTE_UNITS, "GB/s", "samples/s", "tokens/s", "px", "%")
_UNIT_SPACE = re.compile(r"(?<=\d) (?=(?:" + "|".join(re.escape(u) for u in UNITS) + r")(?![\w/]))")
_HELD = "\0"
_COMMAND = re.compile(r"\bgpipe train --resume \S.*$")
FILE_WIDTH = 200  # columns when no terminal sets them: a log keeps each table row and line on one line


def redraws(stream: TextIO) -> bool:
    """Whether `stream` is a terminal that can redraw a live view (a dumb one, as Emacs's shell, only appends)."""
    return stream.isatty() and os.environ.get("TERM", "") not in ("dumb", "unknown")


def output_console(least: int = 0) -> Console:
    """The terminal's console; elsewhere one of at least FILE_WIDTH (or `least`) columns that wraps no line."""
    console = Console()
    # rich takes FORCE_COLOR for a terminal: the colour is kept, but a pipe's tables were cut to 80 columns.
    forced = bool(os.environ.get("FORCE_COLOR")) and not console.file.isatty()
    if console.is_terminal and not forced:
        return console
    return Console(width=max(console.width, FILE_WIDTH, least), soft_wrap=True, force_terminal=console.is_terminal)


def figure_table(title: str, columns: Iterable[str], left: Collection[str] = (), **settings: Any) -> Table:
    """A table of figures: its columns right-aligned but those named in `left` (`settings`: the Table's own)."""
    table = Table(title=title, **settings)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right")
    return table


_PIECE = re.compile(r"(?<=,) ")  # where a cell of several figures ("4.55 @1200, acc 0.81") may break


def _words(line: str) -> list[str]:
    """A line's words, a number and its unit one word."""
    return [word.replace(_HELD, " ") for word in _UNIT_SPACE.sub(_HELD, line).split()]


def wrap_words(text: str, width: int) -> str:
    """`text` broken between words into lines of at most `width` (a number kept with its unit, a long word whole)."""
    lines: list[str] = []
    for line in text.splitlines():
        out: list[str] = []
        for word in _words(line):
            if out and cell_len(f"{out[-1]} {word}") <= width:
                out[-1] += f" {word}"
            else:
                out.append(word)
        lines += out or [""]
    return "\n".join(lines)


def _plain(cell: RenderableType) -> str:
    """The text a cell shows (a str cell is markup)."""
    return cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain


def _span(column: Column, prose: bool = False) -> tuple[int, int]:
    """A column's least width that breaks no figure (`prose`: cells too break between words) and its widest line."""
    header = _plain(column.header)
    lines = [line for cell in column._cells for line in _plain(cell).splitlines()]
    pieces = ([word for line in lines for word in _words(line)] if prose
              else [piece for line in lines for piece in _PIECE.split(line)])
    least = max([cell_len(word) for word in header.split()] + [cell_len(piece) for piece in pieces], default=1)
    return least, max([cell_len(line) for line in (*header.splitlines(), *lines)] + [least])


def _frame(columns: int) -> int:
    """The columns rich's default box takes around `columns` columns: a space each side, a line between and around."""
    return 3 * columns + 1


def _widths(spans: list[tuple[int, int]], room: int, prose: Sequence[bool] = ()) -> list[int]:
    """Each column at least its least width; the room left makes nearest-to-whole headers whole, then `prose` wider."""
    # The `prose` columns share what is left by what each lacks: a few lines of each, not one whole and one a word a
    # line.
    widths = [least for least, _ in spans]
    worded = [i < len(prose) and prose[i] for i in range(len(spans))]
    left = room - sum(widths)
    for i in sorted((i for i in range(len(spans)) if not worded[i]), key=lambda i: spans[i][1] - spans[i][0]):
        grow = max(0, min(left, spans[i][1] - widths[i]))
        widths[i] += grow
        left -= grow
    lacking = {i: spans[i][1] - widths[i] for i in range(len(spans)) if worded[i] and spans[i][1] > widths[i]}
    total = sum(lacking.values())
    for i, lack in lacking.items():
        grow = min(lack, left * lack // total)
        widths[i] += grow
    return widths


def _rewrap(cell: RenderableType, width: int) -> RenderableType:
    """A cell of several figures longer than `width`, broken after their commas only, so each figure stays whole."""
    text = _plain(cell)
    if cell_len(text) <= width or "\n" in text:
        return cell
    lines: list[str] = []
    for piece in _PIECE.split(text):
        if lines and cell_len(lines[-1]) + 1 + cell_len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append(piece)
    return Text("\n".join(lines))


def _part(table: Table, chosen: list[int], width: int, title: str | Text | None, caption: str | Text | None,
          prose: Collection[str] = ()) -> Table:
    """The columns `chosen` of `table` (every row), each given a width so that together they fit `width`."""
    columns = [table.columns[i] for i in chosen]
    worded = [_plain(column.header) in prose for column in columns]
    widths = _widths([_span(column, w) for column, w in zip(columns, worded)], width - _frame(len(columns)),
                     worded)
    part = copy.copy(table)
    part.title, part.caption, part.rows = title, caption, list(table.rows)
    # A fixed width is one rich never narrows below; fold, not an ellipsis, should a figure still not fit.
    part.columns = [dataclasses.replace(column, width=w, overflow="fold", no_wrap=False, _index=j,
                                        _cells=[Text(wrap_words(_plain(cell), w)) if words else _rewrap(cell, w)
                                                for cell in column._cells])
                    for j, (column, w, words) in enumerate(zip(columns, widths, worded))]
    return part


def _records(table: Table, keys: list[int]) -> list[Table]:
    """`table` as one two-column table per row, named by its `keys` cells: for a terminal too narrow for the keys."""
    parts = []
    for r in range(len(table.rows)):
        # The first key is the row's name as it stands (a run); the others say what they are ("stage 2").
        name = ", ".join(text if n == 0 else f"{_plain(table.columns[i].header)} {text}"
                         for n, i in enumerate(keys) if (text := _plain(table.columns[i]._cells[r])))
        part = Table(title=f"{_plain(table.title or '')}: {name}" if table.title else name, show_header=False,
                     caption=table.caption if r == len(table.rows) - 1 else None)
        part.add_column(overflow="fold")
        part.add_column(justify="right", overflow="fold")
        for i, column in enumerate(table.columns):
            if i not in keys:
                part.add_row(Text(" ".join(_plain(column.header).split())), column._cells[r])
        parts.append(part)
    return parts


def fit_table(table: Table, width: int, keys: Collection[str] = (), prose: Collection[str] = ()) -> list[Table]:
    """`table` at `width` with no figure cut: headers wrap between words, columns left over go to more tables."""
    # Each further table repeats the columns named in `keys`, which say whose each row is (a run, a stage); the
    # cells of the columns named in `prose` wrap between words too.
    spans = [_span(column, _plain(column.header) in prose) for column in table.columns]
    if sum(natural for _, natural in spans) + _frame(len(spans)) <= width:
        return [table]  # as rich lays it out: the table at a wide terminal is as it always was
    key = [i for i, column in enumerate(table.columns) if _plain(column.header) in keys]

    def fits(chosen: list[int]) -> bool:
        return sum(spans[i][0] for i in chosen) + _frame(len(chosen)) <= width

    groups: list[list[int]] = [[]]
    for i in (i for i in range(len(spans)) if i not in key):
        if groups[-1] and not fits(key + groups[-1] + [i]):
            groups.append([])
        groups[-1].append(i)
    if not all(fits(key + group) for group in groups):
        return _records(table, key)
    many = len(groups) > 1
    title = _plain(table.title) if table.title is not None else ""
    return [_part(table, sorted(key + group), width,
                  f"{title} ({n} of {len(groups)})" if many and title else table.title,
                  table.caption if n == len(groups) else None, prose) for n, group in enumerate(groups, 1)]


def print_table(console: Console, table: Table, keys: Collection[str] = (), prose: Collection[str] = ()) -> None:
    """Print `table` as `fit_table` lays it out at the console's width."""
    for part in fit_table(table, console.width, keys, prose):
        print_rows(console, part)


def print_rows(console: Console, table: Table) -> None:
    """Print `table`; into a file or pipe, each row ends at its last character, not padded to the table's width."""
    if console.is_terminal:
        console.print(table)
        return
    with console.capture() as captured:  # spaces to the width were noise in a diff, and whole lines of them in grep
        console.print(table)
    console.out("\n".join(line.rstrip() for line in captured.get().split("\n")), end="", highlight=False)


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
    # A command to copy (`continue with gpipe train --resume RUN`) goes whole onto the next line, not cut after
    # `--resume`, which alone resumes the recipe's newest run.
    held = _COMMAND.sub(lambda command: command[0].replace(" ", _HELD), held)
    return textwrap.fill(held, width, subsequent_indent=indent, break_long_words=False,  # a long path stays whole
                         break_on_hyphens=False).replace(_HELD, " ")


def say(text: str, stream: TextIO) -> None:
    """Print a line: on a terminal wrapped at spaces to its width, elsewhere whole (a log keeps one line each)."""
    if stream.isatty():
        text = "\n".join(fit(line, shutil.get_terminal_size().columns) for line in text.split("\n"))
    print(text, file=stream, flush=True)
