"""`train.profile`: record chosen steps with torch.profiler on every rank, one Chrome trace per rank.

The engine marks each scheduled action as a named range ("fwd mb0", "recv_bwd mb3", ...), so the
trace shows the pipeline's schedule above the operators and kernels it ran.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpipe_cli.recipe.schema import Profile


def trace_path(run_dir: Path, rank: int) -> Path:
    """Where a rank's trace goes: RUN_DIR/profile/rank<N>.json (opens in Perfetto or chrome://tracing)."""
    return run_dir / "profile" / f"rank{rank}.json"


class StepProfiler:
    """Starts torch.profiler before the first chosen step and writes the trace after the last."""

    def __init__(self, config: Profile | None, run_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = config.steps if config is not None else (0, -1)
        self.path = trace_path(run_dir, rank)
        self._activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profiler: profile | None = None
        self.written: Path | None = None

    def before(self, step: int) -> None:
        """Called before step `step` (from 1): starts recording at the first chosen step."""
        if step == self.first and self._profiler is None:
            self._profiler = profile(activities=self._activities)
            self._profiler.start()

    def after(self, step: int) -> Path | None:
        """Called after step `step`: after the last chosen step, writes the trace and returns its path."""
        return self.close() if step >= self.last else None

    def close(self) -> Path | None:
        """Stop recording (also when the run ends early) and write what was recorded."""
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))
        self.written = self.path
        return self.path
