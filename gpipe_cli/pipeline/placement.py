"""Which stage runs which chunk of layers: "loop" (chunk c on stage c mod K) or "v" (down and back up)."""

# Imports nothing heavy: the configuration's checks use it before torch loads.
from __future__ import annotations

import functools


def owner(chunk: int, stages: int, placement: str = "loop") -> int:
    """The stage that runs `chunk`."""
    turn, at = divmod(chunk, stages)
    if placement == "v" and turn % 2:
        return stages - 1 - at
    return at


def chunks_of(stage: int, stages: int, virtual: int, placement: str = "loop") -> list[int]:
    """The chunks `stage` runs, in ascending order."""
    return list(_chunks_of(stage, stages, virtual, placement))


@functools.lru_cache(maxsize=1024)
def _chunks_of(stage: int, stages: int, virtual: int, placement: str) -> tuple[int, ...]:
    # Memory searches ask this for every cut they price.
    return tuple(c for c in range(stages * virtual) if owner(c, stages, placement) == stage)


def last_stage(stages: int, virtual: int, placement: str = "loop") -> int:
    """The stage that runs the last chunk (the one with the loss)."""
    return owner(stages * virtual - 1, stages, placement)


def cut_owners(stages: int, virtual: int, placement: str = "loop") -> list[int] | None:
    """Each chunk's stage where a cut must even out stages rather than chunks (under a V), else None."""
    # A V's stage 0 holds the first and the last chunk; under a loop equal chunks make equal stages.
    return [owner(c, stages, placement) for c in range(stages * virtual)] if placement == "v" else None
