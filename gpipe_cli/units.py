"""Numbers for people: bytes as KiB/MiB/GiB, counts as K/M/B."""

from __future__ import annotations

import math
import re

from gpipe_cli.errors import UserError, cut


def meminfo_available() -> int | None:
    """The RAM the kernel could give without swapping (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def human_bytes(n: float | None) -> str:
    """Bytes as B, KiB, MiB, GiB or TiB ("-" for None)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_count(n: float) -> str:
    """A count as 1.23B, 4.56M, 7.89K or the number itself."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


MAX_SIZE = 2**80  # bytes: 1 YiB, beyond any device and well within what an int and a float hold
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """`8GiB`, `16GB`, `500MiB` or a plain number of bytes; one line naming `flag` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UserError(f"{flag} expects a size such as 8GiB, 16GB or 500MiB (got '{text}')")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:  # hundreds of digits: infinity, which no int holds
        raise UserError(f"{flag} must be at most 1 YiB, a size such as 8GiB, 16GB or 500MiB (got '{cut(text)}')")
    return int(value)
