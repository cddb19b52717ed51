"""torch.distributed.pipelining's counterpart of the measured schedule, on our layers, timed and metered like ours."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpipe_cli.estimate.measure import Load, gather, median, timed
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import partition, placement, schedules
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter, cuda_peak_bytes, held, reset_cuda_peak, unwrap
from gpipe_cli.pipeline.topology import Topology

if TYPE_CHECKING:
    from gpipe_cli.bench.setup import Job


def counterpart(schedule: str) -> tuple[str, type | None, str]:
    """torch's class for our schedule: its name, the class (None when missing) and why it is missing."""
    # Every counterpart places chunks round-robin, as ours.
    kind = schedules.REGISTRY.get(schedule)
    cls_name = kind.torch_counterpart if kind is not None else None
    if cls_name is None:
        return "", None, f"torch.distributed.pipelining has no counterpart of '{schedule}'"
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, cls_name, None)
    return cls_name, cls, "" if cls is not None else f"torch {torch.__version__} has no {cls_name}"


class _Slot:
    """The graph's placeholder for one tensor a checkpointed forward would have saved."""

    __slots__ = ("frame", "value", "__weakref__")

    def __init__(self, frame: _Frame) -> None:
        self.frame, self.value = frame, None  # value: the meter's handle once recomputed


class _Frame:
    """One checkpointed forward: its function, input, RNG state and the placeholders it handed out."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], meter: ActivationMeter) -> None:
        self.fn, self.meter = fn, meter
        # Detached (same storage), so the stored input keeps no graph alive; held through the meter, so it is
        # counted for as long as the graph may recompute from it (until the weight gradient, when split).
        self.args = [meter.hold(a.detach().requires_grad_(a.requires_grad)) if isinstance(a, torch.Tensor) else a
                     for a in args]
        self.cpu_rng = torch.get_rng_state()
        self.devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.slots: list[weakref.ref[_Slot]] = []
        self.recomputed = False

    def pack(self, tensor: torch.Tensor) -> _Slot:
        """Hand the graph a placeholder instead of the tensor."""
        slot = _Slot(self)
        self.slots.append(weakref.ref(slot))
        return slot

    def recompute(self) -> None:
        """Run the forward again and fill every placeholder still in use, in the order they were made."""
        index = 0

        def capture(tensor: torch.Tensor) -> None:
            nonlocal index
            slot = self.slots[index]() if index < len(self.slots) else None
            index += 1
            if slot is not None:
                slot.value = self.meter.hold(tensor.detach())
            # The recomputed graph itself is never run backward: it keeps nothing (returning the tensor
            # would let a saved output keep its own graph alive, a cycle nothing collects).

        with torch.random.fork_rng(devices=self.devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(capture, _never):
            torch.set_rng_state(self.cpu_rng)
            for device, state in zip(self.devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            self.fn(*held(self.args))
        if index != len(self.slots):
            raise RuntimeError(f"the recomputed forward saved {index} tensors, the original {len(self.slots)}: "
                               f"the layers are not deterministic under recomputation")
        self.recomputed = True


def _never(_: Any) -> torch.Tensor:
    raise RuntimeError("a recomputed forward's own graph is never run backward")


def _unpack(slot: _Slot) -> torch.Tensor:
    if slot.value is None and not slot.frame.recomputed:
        slot.frame.recompute()
    if slot.value is None:
        raise RuntimeError("a checkpointed activation was asked for after the graph released it")
    return unwrap(slot.value)


# Not `torch.utils.checkpoint`, which would keep the recomputed tensors out of the meter's sight: here each is held
# through the meter until the graph lets go of its placeholder, so recomputation weighs what our engine's does.
def checkpoint(fn: Callable[..., Any], args: Sequence[Any], meter: ActivationMeter) -> Any:
    """`fn(*args)` keeping no activation; they are recomputed, and counted by `meter`, when backward needs them."""
    frame = _Frame(fn, args, meter)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        return fn(*args)


class _Probe:
    """What every stage of this rank shares: the meter, its compute clock and the micro-batches to recompute."""

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter, self.busy = meter, 0.0
        self.remat: set[tuple[int, int]] = set()  # (micro-batch, chunk) forwards to checkpoint
        self.order: list[sched.Step] = []  # (forward | backward | weight, micro-batch, chunk) as torch ran them


class _Chunk(nn.Module):
    """Our layers as one torch stage: one argument (a tensor or a tuple), checkpointed when told to."""

    def __init__(self, layers: list[nn.Module], probe: _Probe) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.probe, self.checkpointed = probe, False

    def forward(self, *args: Any) -> Any:
        # Their stages pass a tuple as several arguments; our layers take it as one.
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._run, args, self.probe.meter)
        return self._run(*args)

    def _run(self, *args: Any) -> Any:
        return self.layers(args[0] if len(args) == 1 else tuple(args))


def _metered_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class MeteredStage(PipelineStage):  # type: ignore[misc, valid-type]
        """A PipelineStage that counts its kept inputs and outputs, clocks its compute and recomputes as ours."""

        probe: _Probe
        held: dict[int, list[Any]]

        def _clocked(self, kind: sched.Kind, run: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            """`run` (the parent's method) on micro-batch `chunk_id`, recorded in torch's order and clocked."""
            self.probe.order.append((kind, chunk_id, self.stage_index))
            start = time.perf_counter()
            out = run(chunk_id, *args, **kwargs)
            self.probe.busy += time.perf_counter() - start
            return out

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            cast(_Chunk, self.submod).checkpointed = (fwd_chunk_id, self.stage_index) in self.probe.remat
            out = self._clocked(sched.Kind.FWD, super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)
            outputs, inputs = self.fwd_cache[fwd_chunk_id]
            self.held[fwd_chunk_id] = [self.probe.meter.hold(t) for t in (*outputs, *inputs)
                                       if isinstance(t, torch.Tensor)]
            return out

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            # Full, or the input gradient only.
            out = self._clocked(sched.Kind.BWD, super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)
            self.held.pop(bwd_chunk_id, None)
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._clocked(sched.Kind.BWD_WEIGHT, super().backward_weight_one_chunk, bwd_chunk_id, *args,
                                 **kwargs)

    return MeteredStage


def compare(spec: ModelSpec, topo: Topology, job: Job, inputs: Any, targets: torch.Tensor) -> dict[str, Any]:
    """Time and meter torch's counterpart of the job's schedule on its model, K, M and cut (figures on rank 0)."""
    layout, device = topo.layout, topo.device

    def on_rank0(figures: dict[str, Any]) -> dict[str, Any]:
        return {f"torch-{job.schedule}": figures} if layout.rank == 0 else {}

    cls_name, cls, missing = counterpart(job.schedule)
    k, chunks, microbatches = layout.stages, len(job.balance), job.microbatches[-1]
    mine = placement.chunks_of(layout.stage, k, chunks // k, schedules.get(job.schedule).placement)
    if cls is None:
        return on_rank0({"class": cls_name, "skipped": missing})
    ranges = partition.stage_ranges(job.balance)
    ours = sched.build(job.schedule, layout.stage, k, microbatches, job.checkpoint, chunks // k)
    meter = ActivationMeter()
    probe = _Probe(meter)
    modules = [_Chunk(build_layers(spec.factories(), ranges[c], job.seed, device), probe).to(device) for c in mine]
    for module in modules:
        module.train()
        meter.exclude([*module.parameters(), *module.buffers()])
    stage_class = _metered_stage_class()
    stages = [stage_class(module, c, chunks, device) for module, c in zip(modules, mine)]
    for stage in stages:
        stage.probe, stage.held = probe, {}
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        # Their loss runs outside the stage's forward; ours inside the last forward: clock it as compute too.
        start = time.perf_counter()
        value = spec.loss(output, target)
        probe.busy += time.perf_counter() - start
        return value

    try:
        single = issubclass(cls, PipelineScheduleSingle)
        schedule = cls(stages[0] if single else stages, microbatches, loss_fn=loss)
    except ValueError as exc:  # torch refuses this K, M (the same on every rank)
        return on_rank0({"class": cls_name, "skipped": f"{cls_name}: {exc}"})
    first, last = 0 in mine, chunks - 1 in mine
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    args = tuple(a.to(device) for a in args) if first else ()
    target = targets.to(device) if last else None
    wall = [0.0]

    def step() -> None:
        for module in modules:
            module.zero_grad(set_to_none=True)
        meter.reset_peak()
        probe.busy = 0.0
        probe.order.clear()
        reset_cuda_peak(device)
        start = time.perf_counter()
        with meter.saved_tensors():
            schedule.step(*args, **({"target": target, "losses": []} if last else {}), return_outputs=False)
        wall[0] = time.perf_counter() - start

    # The first step, unmeasured, only learns torch's order of work (recomputing every forward, so that it
    # fits wherever the measured steps do); then the mode picks what to recompute.
    probe.remat = {(mb, c) for mb in range(microbatches) for c in mine}
    timed(step)
    probe.remat = sched.remat_pairs(job.checkpoint, probe.order)
    for _ in range(job.warmup):
        timed(step)
    times, peaks, idle = [], [], []
    load = Load()
    for _ in range(job.steps):
        times.append(timed(step)[0])
        peaks.append(cuda_peak_bytes(device) if device.type == "cuda" else meter.peak)
        idle.append(max(wall[0] - probe.busy, 0.0) / wall[0] if wall[0] > 0 else 0.0)
    shares = load.finish()
    rows = gather([max(peaks), median(idle), len(probe.remat), len(sched.rematerialised(ours))])
    stage_peaks = [int(r[0]) for r in rows[:k]]
    stage_idle = [r[1] for r in rows[:k]]
    return on_rank0({"class": cls_name, "samples_per_s": job.batch_size / median(times) if times else 0.0,
                     "step_times": times, "stage_peak_bytes": stage_peaks, "peak_mem_bytes": max(stage_peaks),
                     "stage_idle": stage_idle, "bubble": sum(stage_idle) / len(stage_idle),
                     "checkpoint": job.checkpoint, "stage_recomputed": [int(r[2]) for r in rows[:k]],
                     "stage_recomputed_ours": [int(r[3]) for r in rows[:k]], "load": shares})
