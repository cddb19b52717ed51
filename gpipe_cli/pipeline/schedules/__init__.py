"""The schedules, by name: adding one is its own module and one line here."""

from __future__ import annotations

from gpipe_cli.pipeline.schedules.base import Schedule
from gpipe_cli.pipeline.schedules.gpipe import GPipe
from gpipe_cli.pipeline.schedules.interleaved import Interleaved
from gpipe_cli.pipeline.schedules.one_f_one_b import OneFOneB
from gpipe_cli.pipeline.schedules.v_shape import VHalf, ZeroBubbleV
from gpipe_cli.pipeline.schedules.zero_bubble import ZeroBubble

REGISTRY: dict[str, Schedule] = {s.name: s for s in (GPipe(), OneFOneB(), Interleaved(), ZeroBubble(),
                                                          ZeroBubbleV(), VHalf())}


def names() -> tuple[str, ...]:
    """Every schedule's name, in the order they are listed."""
    return tuple(REGISTRY)


def get(name: str) -> Schedule:
    """The schedule called `name`; one line naming the allowed ones otherwise."""
    found = REGISTRY.get(name)
    if found is None:
        raise ValueError(f"unknown schedule '{name}': allowed are {', '.join(REGISTRY)}")
    return found


__all__ = ["REGISTRY", "Schedule", "get", "names"]
