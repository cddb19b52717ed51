"""What each stage holds during a real training step, measured one stage at a time in this process.

A stage's memory depends only on its own layers and on its own action list: which micro-batches it
has run forward and not yet backward, and which of those keep a graph. So each stage is measured by
driving the engine's own `Stage` through the engine's own schedule (`schedule.build`) for that stage,
fed the previous stage's real outputs and ones as output gradients. The figures are what that stage
holds in a multi-rank step; messages in flight, which the engine never counts, are left out.

On CPU the bytes come from the engine's exact saved-tensor accounting (`ActivationMeter`); on CUDA
from the allocator (allocated bytes less parameters and gradients). Each figure says which.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from gpipe_cli.memory_model import OPTIMIZERS
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import microbatch, partition
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter
from gpipe_cli.pipeline.schedule import Kind
from gpipe_cli.pipeline.stage import Stage, as_tensors


def method(device: torch.device) -> str:
    """How activation bytes are measured on `device`."""
    return ("CUDA allocator (allocated bytes less parameters and gradients)" if device.type == "cuda"
            else "exact saved-tensor accounting (CPU)")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds: weights, gradients, optimizer state, stored and peak activations."""

    stage: int
    first_layer: int
    layers: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    stored_bytes: int   # the most kept from forwards when a backward-phase action starts (boundary inputs,
    #                     and the graphs of micro-batches not rematerialised)
    peak_bytes: int     # the peak of the step: stored plus the micro-batch being recomputed and backpropagated

    @property
    def total_bytes(self) -> int:
        """What the device needs at the stage's peak."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.peak_bytes

    def to_json(self) -> dict[str, Any]:
        """As plain data, with the total."""
        return {**asdict(self), "total_bytes": self.total_bytes}


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


class _Counter:
    """Current and peak activation bytes of one stage, by the method of its device."""

    def __init__(self, meter: ActivationMeter, module: nn.Module, device: torch.device) -> None:
        self.meter, self.module, self.device = meter, module, device
        self.cuda = device.type == "cuda"
        self.base = torch.cuda.memory_allocated(device) if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        meter.reset_peak()

    def _grads(self) -> int:
        return _unique_bytes([p.grad for p in self.module.parameters() if p.grad is not None])

    def current(self) -> int:
        if self.cuda:
            return max(torch.cuda.memory_allocated(self.device) - self.base - self._grads(), 0)
        return self.meter.current

    def peak(self) -> int:
        if self.cuda:
            return max(torch.cuda.max_memory_allocated(self.device) - self.base - self._grads(), 0)
        return self.meter.peak


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """What the next stage receives: a fresh leaf that requires grad when floating (as the transport makes it)."""
    if t is None:
        return None
    return t.detach().requires_grad_(t.is_floating_point())


def measure(spec: ModelSpec, inputs: Any, targets: torch.Tensor, balance: list[int], microbatches: int,
            schedule: str, checkpoint: str, optimizer: str, seed: int,
            device: torch.device | str = "cpu") -> list[StageMemory]:
    """Every stage's memory during one step of `balance` with M micro-batches (stages run one after another)."""
    device = torch.device(device)
    stages = len(balance)
    split = microbatch.sizes(microbatch.batch_size(inputs), microbatches)
    offsets = microbatch.offsets(split)
    feed = [as_tensors(mb) for mb in microbatch.scatter(inputs, microbatches)]
    feed = [([None if t is None else t.to(device) for t in ts], bare) for ts, bare in feed]
    labels = [t.to(device) for t in microbatch.scatter(targets, microbatches)]
    units = [float(spec.units(t)) if spec.units else float(t.shape[0]) for t in labels]
    weights = [u / sum(units) for u in units]
    out: list[StageMemory] = []
    for s, span in enumerate(partition.stage_ranges(balance)):
        last = s == stages - 1
        layers = build_layers(spec.factories(), span, seed, device)
        module = nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(span, layers))).to(device)
        module.train()
        meter = ActivationMeter([*module.parameters(), *module.buffers()])
        stage = Stage(module, device, spec.loss if last else None, meter)
        counter = _Counter(meter, module, device)
        actions = sched.build(schedule, s, stages, microbatches, checkpoint)
        remat = sched.rematerialised(actions)
        sent: dict[int, tuple[list[torch.Tensor | None], bool]] = {}
        stored = 0
        for action in actions:
            mb = action.microbatch
            # What the forwards left behind, read before a micro-batch's graph is (re)built for backward.
            if action.kind == Kind.RECOMPUTE or (action.kind in sched.GRADIENT and mb not in remat):
                stored = max(stored, counter.current())
            if action.kind == Kind.FWD:
                tensors, bare = feed[mb]
                result = stage.forward(mb, tensors, bare, offsets[mb], action.remat,
                                       labels[mb] if last else None, weights[mb] if last else 0.0)
                sent[mb] = result
            elif action.kind == Kind.RECOMPUTE:
                stage.recompute(mb)
            elif action.kind in sched.GRADIENT:
                grads = None if last else [None if t is None or not t.is_floating_point() else torch.ones_like(t)
                                           for t in sent[mb][0]]
                (stage.backward if action.kind == Kind.BWD else stage.backward_input)(mb, grads)
            elif action.kind == Kind.BWD_WEIGHT:
                stage.backward_weight(mb)
        params = [p for p in module.parameters() if p.requires_grad]
        grads_bytes = _unique_bytes([p.grad for p in params if p.grad is not None])
        opt = OPTIMIZERS[optimizer](params)
        opt.step()
        state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        out.append(StageMemory(s, span.start, len(span), _unique_bytes(params), grads_bytes,
                               _unique_bytes(state), stored, counter.peak()))
        feed = [([_leaf(t) for t in sent[mb][0]], sent[mb][1]) for mb in range(microbatches)]
        del stage, module, layers, opt, sent
    return out
