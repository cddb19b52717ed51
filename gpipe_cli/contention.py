"""Whether other processes took this machine's CPU while a command timed it, and the one note that says so."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping

# A share of the machine's CPU that others (or the hypervisor) may take before speed figures are called unreliable.
THRESHOLD = 0.05
RATE = "this machine's rate"  # how a note names the window of the quick rate's measurement (`sizing.this_machine`)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity: a Slurm job's or a `taskset`'s share of the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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


# On a shared machine a timing measures the neighbours too: the machine's busy CPU seconds less the measured
# processes' own are what others used; in a virtual machine, "steal" is what the hypervisor gave away.
class Load:
    """Started at the start of a measured window; `finish` gives the shares of the machine's CPU others took."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.machine = machine_cpu() if self.reads() else None
        self.mine = time.process_time()

    def reads(self) -> bool:
        """Whether this process reads the machine's figures (of several ranks, one does)."""
        return True

    def own(self, seconds: float) -> float:
        """The CPU seconds of every process measured, from this one's `seconds`."""
        return seconds

    def finish(self) -> dict[str, float]:
        """The shares of the machine's CPU time used by others and stolen ({} where it cannot be read)."""
        ranks_cpu = self.own(time.process_time() - self.mine)
        now = machine_cpu() if self.machine is not None else None
        if self.machine is None or now is None:
            return {}
        window = time.perf_counter() - self.started
        capacity = window * (os.cpu_count() or 1)
        busy, steal = now[0] - self.machine[0], now[1] - self.machine[1]
        return {"window_s": window, "ranks_cpu_s": ranks_cpu, "machine_busy_s": busy,
                "others_share": max(busy - ranks_cpu, 0.0) / capacity, "stolen_share": steal / capacity}


def _taken(load: Mapping[str, float]) -> float:
    """The larger share of the machine's CPU that others used or the hypervisor stole."""
    return max(load.get("others_share", 0.0), load.get("stolen_share", 0.0))


def contended(load: Mapping[str, float], threshold: float = THRESHOLD) -> bool:
    """Whether other processes or the hypervisor took more than `threshold` of the machine's CPU."""
    return _taken(load) > threshold


def worst(loads: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Of several windows' loads, the one others took most from ({} for none)."""
    found = max(loads, key=_taken, default=None)
    return dict(found) if found is not None else {}


def note(loads: Mapping[str, Mapping[str, float]]) -> str:
    """The warning above speed figures timed while others took the CPU, each window named (rich markup)."""
    parts = [f"{name}: {load.get('others_share', 0):.0%} to other processes, {load.get('stolen_share', 0):.0%} stolen"
             for name, load in loads.items() if load]
    return (f"[bold yellow]CONTENDED:[/] while measuring, the machine's CPU went elsewhere ({'; '.join(parts)}): "
            f"the speed figures below are unreliable")
