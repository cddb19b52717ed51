"""Numbers for people: bytes as KiB/MiB/GiB, counts as K/M/B, ranges as 4-7 (or 4), seconds."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import Any

from gpipe_cli.errors import UserError, cut


def meminfo_available() -> int | None:
    """The RAM the kernel could give without swapping (Linux), or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


# Up to YiB: a size flag takes up to 1 YiB (MAX_SIZE), and 99999 EiB read '104856551424.0 TiB' in TiB.
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def human_bytes(n: float | None, up: bool = False) -> str:
    """Bytes as B, KiB, MiB, ... YiB ("-" for None); `up`: rounded up, so that a size named from it holds `n`."""
    if n is None:
        return "-"
    value = float(n)
    for unit in BYTE_UNITS:
        if abs(value) < 1024 or unit == BYTE_UNITS[-1]:
            break
        value /= 1024
    if up:  # to the digits shown; the 1e-9 keeps a whole figure from going up for a float's error
        value = math.ceil(value - 1e-9) if unit == "B" else math.ceil(value * 10 - 1e-9) / 10
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def size_flag(n: float) -> str:
    """`n` bytes as a size flag takes it, rounded up so that it holds them: '901.8MiB' (human_bytes' figure)."""
    return human_bytes(n, up=True).replace(" ", "")


def figure(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def share(fraction: float) -> str:
    """`fraction` as a percentage: one decimal, or two significant digits under 0.1% (a small model on a GPU)."""
    return f"{percent:.2g}%" if 0 < (percent := fraction * 100) < 0.1 else f"{fraction:.1%}"


def number_range(first: int, last: int) -> str:
    """`first`-`last` as "4-7", or "4" when they are the same (a range of one)."""
    return str(first) if first == last else f"{first}-{last}"


def human_seconds(seconds: float, scale: float | None = None) -> str:
    """e.g. "40 s", "3 min", "2.5 h"; in the unit `scale` seconds would take, so that two figures compare."""
    # Beside another figure, a whole minute can hide a third of it: 80 s is not "1 min".
    digits = 1 if scale is not None and scale < 600 else 0
    scale = seconds if scale is None else scale
    if scale < 90:
        return f"{max(seconds, 1):.0f} s"
    if scale < 5400:
        return f"{seconds / 60:.{digits}f} min"
    return f"{seconds / 3600:.1f} h"


def clock(seconds: float) -> str:
    """e.g. "42s", "1m23s", "2h05m": a countdown that stays short on a step line."""
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def flop_rate(per_s: float) -> str:
    """A FLOP rate for people: "312 TFLOP/s", or "0.667 GFLOP/s" below one TFLOP/s (CPUs)."""
    return f"{per_s / 1e12:.3g} TFLOP/s" if per_s >= 1e12 else f"{per_s / 1e9:.3g} GFLOP/s"


def counted(n: int | str, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, singular for one: '1 device', '1,024 devices' (`plural`: where not the noun and 's')."""
    # `n` a letter: a size a table's rows fill in (`with L layers`).
    return f"{f'{n:,}' if isinstance(n, int) else n} {noun if n == 1 else plural or noun + 's'}"


def human_count(n: float) -> str:
    """A count as 1.23T, 1.23B, 4.56M, 7.89K or the number itself."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


MAX_SIZE = 2**80  # bytes: 1 YiB, beyond any device and well within what an int and a float hold
# A size is one number and an optional unit, nothing else: pydantic's ByteSize reads the number and unit, but its
# pattern is anchored at the start only ("8GiB,16GiB" would silently be 8 GiB), so the whole text is matched here.
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
# The units taken: bytes, powers of 1000 and of 1024. Not ByteSize's one-letter units, which it reads as powers
# of 1000 where Java and Docker read 8g as 8 GiB, nor its bits: memory is not given in either.
_UNITS = ("", "b", "kb", "mb", "gb", "tb", "pb", "eb", "kib", "mib", "gib", "tib", "pib", "eib")
_ONE_LETTER = "KMGTPE"  # `8G`: 8 GB or 8 GiB? Asked back, in the powers each would be


@functools.lru_cache(maxsize=1)
def _byte_size() -> Any:
    # pydantic's validators are built on first use, not by every command that imports this module.
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize)


def parse_size(text: str, flag: str) -> int:
    """`8GiB`, `16GB`, `500MiB`, `1.5 KiB` or a plain number of bytes; one line naming `flag` otherwise."""
    from pydantic import ValidationError

    expected = f"{flag} expects a size such as 8GiB, 16GB or 500MiB (got '{cut(text)}')"
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match and len(unit) == 1 and unit in _ONE_LETTER:
        number, power = match.group(1), _ONE_LETTER.index(unit) + 1
        raise UserError(f"{flag} {cut(text.strip())}: say {number}{unit}B (10^{3 * power} bytes) or {number}{unit}iB "
                        f"(2^{10 * power} bytes); a one-letter unit is ambiguous")
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(expected)
    whole = match.group(1).partition(".")[0].lstrip("0")
    try:  # more whole digits than 1 YiB has bytes: too large in any unit (and some pydantic refuse the length)
        value = MAX_SIZE + 1 if len(whole) > len(str(MAX_SIZE)) else int(_byte_size().validate_python(text))
    except ValidationError:
        raise UserError(expected) from None
    if value > MAX_SIZE:
        raise UserError(f"{flag}: must be at most 1 YiB, a size such as 8GiB, 16GB or 500MiB (got '{cut(text)}')")
    return value
