"""torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on our layers, timed and metered like ours.

Each rank wraps the same layers our engine ran (same seed, same cut) in a `PipelineStage`. Memory is
measured by the method our engine uses: the same `ActivationMeter` counts every tensor autograd saves
during their step (the hooks wrap the whole step, loss included) plus the stage inputs and outputs
they keep from a micro-batch's forward until its backward. On CUDA both sides report the allocator's
peak instead.

Their known trap: receive buffers are allocated once, from the first micro-batch's shapes, so the
batch must split into equal micro-batches (the options refuse anything else with --compare).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe_cli.bench.load import Load
from gpipe_cli.bench.measure import median, timed
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import partition
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter
from gpipe_cli.pipeline.topology import Topology

if TYPE_CHECKING:
    from gpipe_cli.bench.job import Job

BASELINES = ("torch-gpipe", "torch-1f1b")


class _Unpacked(nn.Module):
    """Our layers take one argument (a tensor or a tuple); their stages pass a tuple as several arguments."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, *args: Any) -> Any:
        return self.layers(args[0] if len(args) == 1 else tuple(args))


def _metered_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class MeteredStage(PipelineStage):  # type: ignore[misc, valid-type]
        """A PipelineStage whose kept inputs and outputs are counted from forward until backward."""

        meter: ActivationMeter
        held: dict[int, list[Any]]

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            outputs, inputs = self.fwd_cache[fwd_chunk_id]
            self.held[fwd_chunk_id] = [self.meter.hold(t) for t in (*outputs, *inputs)
                                       if isinstance(t, torch.Tensor)]
            return out

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            self.held.pop(bwd_chunk_id, None)
            return out

    return MeteredStage


def _make_schedule(name: str, stage: Any, microbatches: int, loss: Any) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    cls = ScheduleGPipe if name == "torch-gpipe" else Schedule1F1B
    return cls(stage, microbatches, loss_fn=loss)


def _peak(meter: ActivationMeter, device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else meter.peak


def run_baseline(name: str, spec: ModelSpec, topo: Topology, job: Job, inputs: Any,
                 targets: torch.Tensor) -> dict[str, Any] | None:
    """Time and meter one baseline schedule; its figures on rank 0, None elsewhere."""
    layout, device = topo.layout, topo.device
    chunks = job.microbatches[-1]
    indices = partition.stage_ranges(job.balance)[layout.stage]
    module = _Unpacked(build_layers(spec.factories(), indices, job.seed, device)).to(device)
    module.train()
    meter = ActivationMeter([*module.parameters(), *module.buffers()])
    stage = _metered_stage_class()(module, layout.stage, layout.stages, device)
    stage.meter, stage.held = meter, {}
    schedule = _make_schedule(name, stage, chunks, spec.loss)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    args = tuple(a.to(device) for a in args) if layout.is_first else ()
    target = targets.to(device) if layout.is_last else None

    def step() -> None:
        module.zero_grad(set_to_none=True)
        meter.reset_peak()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with meter.saved_tensors():
            if layout.is_last:
                schedule.step(*args, target=target, losses=[], return_outputs=False)
            else:
                schedule.step(*args, return_outputs=False)

    times, peaks = [], []
    load: Load | None = None
    for index in range(job.warmup + job.steps):
        if index == job.warmup:
            load = Load()
        seconds, _ = timed(step)
        if index >= job.warmup:
            times.append(seconds)
            peaks.append(_peak(meter, device))
    shares = load.finish() if load is not None else {}
    mine = torch.tensor([max(peaks)], dtype=torch.float64)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(layout.world_size)]
    if dist.is_initialized() and layout.world_size > 1:
        dist.all_gather(gathered, mine)
    else:
        gathered = [mine]
    if layout.rank != 0:
        return None
    return {"samples_per_s": median([job.batch_size / t for t in times]), "step_times": times,
            "stage_peak_bytes": [int(g[0]) for g in gathered], "peak_mem_bytes": int(max(g[0] for g in gathered)),
            "load": shares}


def compare(spec: ModelSpec, topo: Topology, job: Job, inputs: Any, targets: torch.Tensor) -> dict[str, Any]:
    """Every baseline on the job's model, K and M (rank 0 gets the figures, keyed by baseline)."""
    out: dict[str, Any] = {}
    for name in BASELINES:
        figures = run_baseline(name, spec, topo, job, inputs, targets)
        if figures is not None:
            out[name] = figures
    return out
