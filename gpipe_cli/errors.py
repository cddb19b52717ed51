"""Errors that reach the user as one clear line and a non-zero exit code, never a traceback."""

from __future__ import annotations

import difflib
import os
import shlex
from collections.abc import Iterable
from typing import Any

# How much of a user's value an error message repeats: enough to recognise it, never a whole file.
SHOWN_CHARS = 60
# How much of a path it repeats: more, since a path's end is what tells it apart.
PATH_SHOWN_CHARS = 160
# Fewer left out than this, and the note saying so would hide what sets the value apart (a path's last digits).
CUT_AT_LEAST = 30
# How alike a typed name and a known one must be to suggest it (difflib's ratio): `--step` finds `--steps`.
NEAR_RATIO = 0.75
# The fewest letters a prefix must have to suggest the names it begins (`--o` would name every --o... option).
PREFIX_CHARS = 2
# The longest line an error may print (a last guard for messages built from user input).
LINE_CHARS = 400


def near(name: str, names: Iterable[str], most: int = 1, prefix: bool = False) -> list[str]:
    """The known names closest to a mistyped one, best first (none where nothing is alike enough); `prefix`: where
    none is alike, those it begins are near it (`out` of `output`, too short for difflib's ratio)."""
    known = sorted(names)
    # Two letters swapped is the commonest slip, and difflib's ratio leaves it out of short names (`tpo`, `top`).
    close = difflib.get_close_matches(name, known, most, NEAR_RATIO) or [k for k in known if _swapped(name, k)][:most]
    if close or not prefix or len(name) < PREFIX_CHARS:
        return close
    return [k for k in known if k.startswith(name)][:most]


def _swapped(a: str, b: str) -> bool:
    """Whether `a` is `b` with two neighbouring characters swapped."""
    apart = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    return len(a) == len(b) and len(apart) == 2 and apart[1] == apart[0] + 1 and a[apart[0]] == b[apart[1]] \
        and a[apart[1]] == b[apart[0]]


class UserError(Exception):
    """Bad input from the user: the message names what was wrong and what is allowed."""

    exit_code = 2


class DataError(UserError):
    """A data source that cannot be read (missing path, unreachable hub, malformed file)."""


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` cut to a readable length, with the number of characters left out (YAML's words as written)."""
    return cut(_words(value), limit)


def shown_path(path: str | os.PathLike[str]) -> str:
    """A path as an error repeats it: whole up to PATH_SHOWN_CHARS, for its end is what tells it apart."""
    return shown(os.fspath(path), PATH_SHOWN_CHARS)


def _words(value: Any) -> str:
    """`repr(value)` with YAML's true, false and null for Python's True, False and None, in lists and mappings too."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:  # more digits than Python converts to text
            return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_words(item) for item in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_words(k)}: {_words(v)}" for k, v in value.items()) + "}"
    return repr(value)


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters, saying how many were left out."""
    if len(text) <= limit + CUT_AT_LEAST:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def as_typed(text: str) -> str:
    """A command-line argument's bytes read as UTF-8 whatever the locale; those that are not stay lone surrogates."""
    # Under a C locale "zéro" reached Python as two undecodable bytes, and was refused as not UTF-8.
    try:
        return os.fsencode(text).decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # text the locale cannot hold did not come from its bytes: it is read already
        return text


def not_utf8(text: str) -> str | None:
    """Where `text` stops being UTF-8, e.g. "byte 0xff at character 3" (None: it is UTF-8 throughout)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes that are not UTF-8 reach Python as lone surrogates (PEP 383)
        return f"byte 0x{ord(text[exc.start]) & 0xFF:02x} at character {exc.start + 1}"
    return None


def one_line(message: str) -> str:
    """A message as one line of readable length: newlines joined; past it, its middle cut (its end says what to do)."""
    text = " ".join(message.split())
    note = f"... ({len(text) - LINE_CHARS} characters left out) ..."
    if len(text) <= LINE_CHARS + len(note):  # the cut would save less than its note
        return text
    tail = LINE_CHARS * 2 // 5
    return f"{text[:LINE_CHARS - tail]}{note}{text[-tail:]}"


NONFINITE_EXIT_CODE = 3  # training stopped on a non-finite loss or gradient; rank 0 has said where


def shell_path(path: str | os.PathLike[str]) -> str:
    """A path as the shell word of a command we advise: quoted, and `./` before a relative one that starts with -."""
    # `gpipe train --resume -run` reads -run as an option: the advice must run as printed.
    text = os.fsdecode(path)
    text = f"./{text}" if text.startswith("-") else text
    return shlex.quote(text) if text.isprintable() else _ansi_c(text)


def path_line(path: str | os.PathLike[str]) -> str:
    """A path as a line of output names it: as it is, or in bash's $'...' when it holds a newline or such."""
    text = os.fsdecode(path)
    return text if text.isprintable() else _ansi_c(text)


def _ansi_c(text: str) -> str:
    """`text` as one bash $'...' word, every unprintable character (and undecodable byte) escaped."""
    def escaped(char: str) -> str:
        if char in "\\'":
            return f"\\{char}"
        if char.isprintable():
            return char
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte os.fsdecode could not decode: the same byte again
            return f"\\x{code - 0xDC00:02x}"
        return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(char) or (
            f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return "$'" + "".join(map(escaped, text)) + "'"
