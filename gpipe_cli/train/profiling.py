"""`train.profile`: chosen steps recorded with torch.profiler on every rank, gzip'd Chrome traces per rank."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from gpipe_cli.errors import path_line
from gpipe_cli.files import atomic_path
from gpipe_cli.recipe.schema import Profile


def trace_path(run_dir: Path, rank: int, first: int, last: int) -> Path:
    """Where a rank's trace of steps `first`..`last` goes (Perfetto and chrome://tracing open it as is)."""
    return run_dir / "profile" / f"steps{first}-{last}" / f"rank{rank}.trace.json.gz"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the profiler for the moment of a transition: its Python warnings, and file descriptor 2."""
    # Kineto prints `USDT: ...` and `STAGE: ...` lines to stderr at every start and stop, whatever KINETO_LOG_LEVEL
    # says, and torch warns of choices made on purpose (no warm-up before step 1).
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with warnings.catch_warnings(), open(os.devnull, "w") as null:
            warnings.simplefilter("ignore")
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class StepProfiler:
    """Steps torch.profiler with the training loop and writes each cycle's trace when its last active step ends."""

    def __init__(self, config: Profile | None, run_dir: Path, rank: int, device: torch.device,
                 total_steps: int = 0) -> None:
        self.total_steps = total_steps  # the run's last step: the profiler is not stepped past it
        self.run_dir, self.rank = run_dir, rank
        self.traced = (0, 0)  # the steps of the last trace written
        self._profiler: profile | None = None
        self._started = False
        self._done = 0  # the last step finished
        self._ready: Path | None = None
        self._failed = False  # a trace could not be written: none is recorded after it
        self._failure = ""  # the line that says so, once stderr is the run's again
        self._schedule: Callable[[int], Any] = lambda step: ProfilerAction.NONE  # a ProfilerAction
        self._last: int | None = None
        if config is None:
            return
        skip_first, wait, warmup, active, repeat = config.cycle()
        self._last = skip_first + repeat * (wait + warmup + active) if repeat else None  # the last step recorded
        # Steps count from 1: the schedule's step 0 is never a training step, so it is skipped first.
        with quiet():  # torch's advice against no warm-up, for a cycle the recipe chose, once per rank
            self._schedule = schedule(skip_first=skip_first + 1, wait=wait, warmup=warmup, active=active,
                                      repeat=repeat)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with quiet():
            self._profiler = profile(activities=activities, schedule=self._schedule, on_trace_ready=self._save,
                                     profile_memory=config.profile_memory, with_stack=config.with_stack,
                                     record_shapes=config.record_shapes)

    def profiled(self, step: int) -> bool:
        """Whether the profiler works in step `step`'s time: warming up or recording, or starting for the next step."""
        # after(step) moves the profiler on inside the step's time (its launch to the next's): its first start
        # there can take seconds, and the trace of a cycle is written there when the step ends it.
        starting = step < self.total_steps and self._schedule(step + 1) != ProfilerAction.NONE
        return starting or self._schedule(step) != ProfilerAction.NONE

    def before(self, step: int) -> None:
        """Called before step `step` (from 1): the first call starts the profiler at that step."""
        profiler = self._profiler
        if profiler is None or self._started:
            return
        self._started = True
        # Number the profiler's steps as the run's (a resumed run starts past 1): ProfilerStep#N is step N.
        profiler.step_num = step
        profiler.current_action = self._schedule(step)
        with quiet():
            profiler.start()

    def after(self, step: int) -> Path | None:
        """Called after step `step`: moves the schedule on; the trace's path if a cycle just ended with it."""
        profiler = self._profiler
        if profiler is None or not self._started:
            return None
        self._ready, self._done = None, step
        # Stepping on past the run's end would open an empty ProfilerStep range; after a failed write, to no end.
        if step == self.total_steps or self._failed:
            return self.close()
        if self._schedule(step + 1) == profiler.current_action == ProfilerAction.NONE:
            profiler.step()  # idle: nothing starts or stops, nothing to silence
        else:
            with quiet():
                profiler.step()
        self._say_failure()
        ready = self._ready
        if self._last is not None and step >= self._last:  # nothing more to record: what it holds goes back now
            self.close()
        return ready

    def close(self) -> Path | None:
        """Stop recording (also when the run ends inside a cycle: what was recorded is written)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None or not self._started:
            return None
        self._ready = None
        with quiet():
            profiler.stop()
        self._say_failure()
        return self._ready

    def _say_failure(self) -> None:
        if self._failure:
            print(self._failure, file=sys.stderr, flush=True)
            self._failure = ""

    def _save(self, profiler: profile) -> None:
        """Write the cycle that just ended: whole, gzip'd, under its final name only once complete."""
        if self._failed:
            return
        last = first = self._done
        while first > 1 and self._schedule(first - 1) == ProfilerAction.RECORD:  # back to the cycle's first
            first -= 1
        path = trace_path(self.run_dir, self.rank, first, last)
        try:
            with atomic_path(path, suffix=".gz") as partial:  # torch gzips a name ending in .gz
                profiler.export_chrome_trace(str(partial))
        except OSError as exc:  # a trace is an aid: the run goes on without more of them
            self._failed = True
            # Said once out of `quiet()`, which holds stderr now; by rank 0, for every rank's trace goes there too.
            if self.rank == 0:
                self._failure = (f"[gpipe] train.profile: cannot write {path_line(path)} ({exc.strerror or exc}); "
                                 "the run goes on without more traces")
            return
        self.traced = (first, last)
        self._ready = path
