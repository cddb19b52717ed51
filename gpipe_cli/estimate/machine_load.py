"""Whether the machine was the job's alone while it was measured: CPU used by other processes, and stolen.

A benchmark on a shared machine measures the neighbours too: the machine's busy CPU seconds (/proc/stat)
less every rank's own are what others used; in a virtual machine, "steal" is what the hypervisor gave away.
"""

from __future__ import annotations

import os
import time
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    """Whether this process is one of several ranks."""
    return dist.is_initialized() and dist.get_world_size() > 1


def gather(value: T) -> list[T]:
    """Every rank's `value`, in rank order."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def machine_cpu() -> tuple[float, float] | None:
    """The whole machine's busy and stolen CPU seconds so far (Linux /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    steal = fields[7] if len(fields) > 7 else 0
    return (sum(fields[:8]) - idle - steal) / hz, steal / hz


class Load:
    """Started on every rank at the start of a measured window; `finish` (on every rank) gives the shares."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.machine = machine_cpu() if not dist.is_initialized() or dist.get_rank() == 0 else None
        self.mine = time.process_time()

    def finish(self) -> dict[str, float]:
        """The shares of the machine's CPU time used by others and stolen, on rank 0 ({} elsewhere)."""
        ranks_cpu = sum(gather(time.process_time() - self.mine))
        now = machine_cpu() if self.machine is not None else None
        if self.machine is None or now is None:
            return {}
        window = time.perf_counter() - self.started
        capacity = window * (os.cpu_count() or 1)
        busy, steal = now[0] - self.machine[0], now[1] - self.machine[1]
        return {"window_s": window, "ranks_cpu_s": ranks_cpu, "machine_busy_s": busy,
                "others_share": max(busy - ranks_cpu, 0.0) / capacity, "stolen_share": steal / capacity}


def contended(load: dict[str, float], threshold: float = 0.05) -> bool:
    """Whether other processes or the hypervisor took more than `threshold` of the machine's CPU."""
    return load.get("others_share", 0.0) > threshold or load.get("stolen_share", 0.0) > threshold
