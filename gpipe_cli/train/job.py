"""What the launcher hands every rank (plain data: importing it costs nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Job:
    """A training job: the resolved recipe and where and how to run it."""

    recipe: dict[str, Any]
    output_dir: str | None = None
    outputs_root: str = "outputs"
    plain: bool | None = None
    resume: str | None = None  # a run directory or checkpoint to continue from
    started: float | None = None  # time.time() when the command started, for elapsed times on screen
    available: float | None = None  # memory free when the plan was checked: the ranks cut for the same
