"""Time training steps on this rank: the engine's, or any other step function, by one common clock."""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpipe_cli import contention
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import partition, placement
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.stats import StepStats
from gpipe_cli.pipeline.topology import Topology


def distributed() -> bool:
    """Whether this process is one of several ranks."""
    return dist.is_initialized() and dist.get_world_size() > 1


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Load(contention.Load):
    """Started on every rank at the start of a measured window; `finish` (on every rank) gives the shares, on rank 0."""

    def reads(self) -> bool:
        """Rank 0 reads the machine's figures."""
        return not dist.is_initialized() or dist.get_rank() == 0

    def own(self, seconds: float) -> float:
        """Every rank's CPU seconds."""
        return float(sum(gather(seconds)))


# Ours and the baselines are timed by this one function, so they compare like with like.
def timed(step: Callable[[], Any]) -> tuple[float, Any]:
    """Run `step` on every rank from a common start; return the slowest rank's seconds and its result."""
    if distributed():
        dist.barrier()
    start = time.perf_counter()
    result = step()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if distributed():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0]), result


def median(values: Sequence[float]) -> float:
    """The median, 0 for no values."""
    return float(statistics.median(values)) if values else 0.0


@dataclass
class StageFigures:
    """One stage's figures from the engine's own statistics (medians over the measured steps)."""

    stage: int
    layers: int
    busy_s: float
    step_s: float
    bubble: float
    activation_peak_bytes: int
    rss_peak_bytes: int
    cuda_peak_bytes: int
    offloaded_peak_bytes: int = 0  # activations waiting in host memory at once (pipeline.offload)


@dataclass
class RunFigures:
    """One measured configuration of our engine, as rank 0 sees it."""

    partitions: int
    microbatches: int
    batch_size: int
    balance: list[int]
    step_times: list[float] = field(default_factory=list)
    units_per_step: float = 0.0
    bubbles: list[float] = field(default_factory=list)
    stages: list[StageFigures] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    cpu_per_busy: list[float] = field(default_factory=list)  # per rank: compute thread's CPU s / compute s
    load: dict[str, float] = field(default_factory=dict)      # what else used the machine (see `Load`)
    optimizer_times: list[float] = field(default_factory=list)  # per step: the slowest stage's update, if run

    # Of the median step time, which the tables print beside them: the median of the rates differs from it by as
    # much as the two middle steps do, for an even count of steps.
    @property
    def samples_per_s(self) -> float:
        """Examples per second in the median step."""
        step = median(self.step_times)
        return self.batch_size / step if step else 0.0

    @property
    def units_per_s(self) -> float:
        """Loss units (tokens for text) per second in the median step."""
        step = median(self.step_times)
        return self.units_per_step / step if step else 0.0

    @property
    def bubble(self) -> float:
        """The measured bubble: the mean over stages of each stage's median idle share."""
        # The mean of the stage table's column, and aggregated as torch's schedules are in `--compare`.
        if self.stages:
            return sum(s.bubble for s in self.stages) / len(self.stages)
        return median(self.bubbles)

    @property
    def peak_bytes(self) -> int:
        """The largest per-stage memory peak (the CUDA allocator's when on CUDA, else stored activations)."""
        return max((s.cuda_peak_bytes or s.activation_peak_bytes for s in self.stages), default=0)

    @staticmethod
    def from_json(data: dict[str, Any]) -> RunFigures:
        """The figures from their `dataclasses.asdict` form."""
        return RunFigures(**{**data, "stages": [StageFigures(**s) for s in data["stages"]]})


def build_pipeline(spec: ModelSpec, topo: Topology, config: PipelineConfig, seed: int) -> Pipeline:
    """This rank's stage of `spec` as `config` cuts and runs it."""
    indices = partition.stage_layers(list(config.balance), config.stages, topo.layout.stage, config.placement)
    layers = build_layers(spec.factories(), indices, seed, topo.device)
    return Pipeline(layers, topo, config, spec.loss, units=spec.units, tied=spec.tied)


def measure_engine(pipe: Pipeline, inputs: Any, targets: torch.Tensor, batch_size: int, microbatches: int,
                   steps: int, warmup: int, trace: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   max_grad_norm: float | None = None) -> RunFigures | None:
    """Run warm-up and measured steps (and one traced step) as in training; the figures on rank 0, None elsewhere."""
    layout = pipe.layout
    feed = inputs if layout.is_first else None
    labels = targets if layout.is_last else None
    figures = RunFigures(layout.stages, microbatches, batch_size, list(pipe.balance))
    history: list[StepStats] = []

    def step(index: int, traced: bool = False) -> Any:
        pipe.zero_grad()
        # Stored activations are counted on the first measured step only: counting costs a Python call
        # per saved tensor, which would be timed too.
        return pipe.train_step(feed, labels, microbatches=microbatches, step=index, trace=traced,
                               max_grad_norm=max_grad_norm, optimizer=optimizer, measure_memory=index == warmup)

    for index in range(warmup):
        timed(functools.partial(step, index))
    cpu = busy = 0.0
    load = Load()
    # As training does after set-up, the collector's full passes no longer walk what lives on (process-wide: where
    # ranks are threads, as in tests, the first to finish unfreezes the others' too, which costs timings only).
    gc.freeze()
    try:
        for index in range(warmup, warmup + steps):
            started = time.thread_time()
            seconds, result = timed(functools.partial(step, index))
            cpu += time.thread_time() - started
            busy += result.own.busy
            figures.step_times.append(seconds)
            if result.stats is not None:
                history.append(result.stats)
    finally:
        gc.unfreeze()
    figures.cpu_per_busy = gather(cpu / busy if busy > 0 else 1.0)
    figures.load = load.finish()
    if trace:
        # A separate step, so that gathering the events never slows a measured one.
        _, result = timed(lambda: step(warmup + steps, traced=True))
        if result.stats is not None:
            figures.events = [e.record() for e in result.stats.events]
    if layout.rank != 0:
        return None
    figures.bubbles = [stats.bubble for stats in history]
    figures.optimizer_times = [max(s.optimizer for s in stats.stages) for stats in history]
    figures.units_per_step = median([stats.units for stats in history])
    for s in range(layout.stages):
        chunks = placement.chunks_of(s, layout.stages, len(figures.balance) // layout.stages, layout.placement)
        rows = [st for stats in history for st in stats.stages if st.stage == s and st.replica == 0]
        figures.stages.append(StageFigures(  # its layers and busy time: of all its chunks
            stage=s, layers=sum(figures.balance[c] for c in chunks), busy_s=median([r.busy for r in rows]),
            step_s=median([r.step_time for r in rows]), bubble=median([r.bubble for r in rows]),
            activation_peak_bytes=max(r.activation_peak for r in rows), rss_peak_bytes=max(r.rss_peak for r in rows),
            cuda_peak_bytes=max(r.cuda_peak for r in rows), offloaded_peak_bytes=max(r.offloaded_peak for r in rows)))
    return figures
