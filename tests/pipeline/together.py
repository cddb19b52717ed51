"""Several rank functions run one after another in the same rank processes, for tests that share their ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# A rank process pays for itself before its first step (the fork, gloo's groups, and torch._dynamo, which the
# first optimizer imports: ~3 s of CPU per rank here), so tests that need the same number of ranks share them.
Call = tuple[Callable[..., Any], tuple]


def several(calls: list[Call]) -> list[Any]:
    """Each call's result, in order, on this rank."""
    return [fn(*args) for fn, args in calls]


def shared_jobs(run: Callable[[int, list[Call]], list[list[Any]]],
                jobs: dict[int, dict[Any, Call]]) -> Callable[[int, Any], list[Any]]:
    """(world, key) -> every rank's result of that call: a world's calls run in one job (`run`), on first demand."""
    done: dict[int, dict[Any, list[Any]]] = {}

    def get(world: int, key: Any) -> list[Any]:
        if world not in done:
            keys = list(jobs[world])
            per_rank = run(world, [jobs[world][k] for k in keys])
            done[world] = {k: [results[i] for results in per_rank] for i, k in enumerate(keys)}
        return done[world][key]

    return get
