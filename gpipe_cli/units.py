"""Numbers for people: bytes as KiB/MiB/GiB, counts as K/M/B."""

from __future__ import annotations


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
