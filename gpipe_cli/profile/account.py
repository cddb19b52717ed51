"""What each stage holds during a real training step, measured one stage at a time in this process."""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from gpipe_cli.memory_model import primed
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import microbatch, partition, placement, schedules
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.comm import Header
from gpipe_cli.pipeline.executor import Channels, Executor, Message, feed_messages
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter, cuda_peak_bytes, reset_cuda_peak
from gpipe_cli.pipeline.offload import Offloader, offloaded
from gpipe_cli.pipeline.schedule import Action, Kind
from gpipe_cli.pipeline.stage import Stage, as_tensors
from gpipe_cli.pipeline.tied import tie_within


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
    host_bytes: int = 0  # the most offloaded activations in host memory at once (pipeline.offload)
    chunks: list[list[int]] | None = None  # first and last layer of each chunk it runs (two under a V)

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
        reset_cuda_peak(device)
        meter.reset_peak()

    def _activations(self, allocated: int) -> int:
        """Allocated bytes less what was held before and the gradients."""
        grads = _unique_bytes([p.grad for p in self.module.parameters() if p.grad is not None])
        return max(allocated - self.base - grads, 0)

    def current(self) -> int:
        return self._activations(torch.cuda.memory_allocated(self.device)) if self.cuda else self.meter.current

    def peak(self) -> int:
        return self._activations(cuda_peak_bytes(self.device)) if self.cuda else self.meter.peak


class _Stored:
    """The most held from forwards, read before a micro-batch's graph is (re)built for its backward."""

    def __init__(self, counter: _Counter, remat: set[tuple[int, int]]) -> None:
        self.counter, self.remat, self.bytes = counter, remat, 0

    def __call__(self, action: Action) -> None:
        """Read before `action` runs."""
        if action.kind == Kind.RECOMPUTE or (action.kind in sched.GRADIENT and
                                             (action.microbatch, action.chunk) not in self.remat):
            self.bytes = max(self.bytes, self.counter.current())


class _Sent:
    """An in-process sink: keeps what a stage sends, by message number, in host memory."""

    def __init__(self) -> None:
        self.messages: dict[int, Message] = {}

    # On a GPU a message kept there would count as the stage's until it ends; the engine's is freed once sent.
    def send(self, microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
             bare: bool = False, differentiable: bool = False) -> None:
        """Keep the message."""
        self.messages[microbatch] = ([None if t is None else t.detach().cpu() for t in tensors], bare, offset)


class _Received:
    """An in-process source: the previous stage's messages as fresh leaves, or ones as output gradients."""

    def __init__(self, messages: dict[int, Message], chunks: int, device: torch.device,
                 ones: bool = False, shift: int = 0) -> None:
        self.messages, self.chunks, self.device, self.ones, self.shift = messages, chunks, device, ones, shift

    def take(self, microbatch: int) -> tuple[Header, list[torch.Tensor | None]]:
        """The message numbered `microbatch` (+ `shift`: a gradient answers the forward it follows)."""
        tensors, bare, offset = self.messages[microbatch + self.shift]
        if self.ones:
            out = [None if t is None or not t.is_floating_point() else torch.ones_like(t, device=self.device)
                   for t in tensors]
        else:  # fresh leaves that require grad when floating, in memory of their own, as the transport makes them
            # (a GPU's allocator then counts a stage's inputs as the engine's stage holds them)
            out = [None if t is None else t.detach().to(self.device, copy=True).requires_grad_(t.is_floating_point())
                   for t in tensors]
        return Header(microbatch, self.chunks, offset, (), bare), out


def _forwards(spec: ModelSpec, ranges: list[range], feed: list[Message], seed: int,
              device: torch.device) -> dict[int, Message]:
    """Every chunk's input messages but the first's, from one forward without a graph through the chunks in order."""
    # Under a V a stage's upper chunk takes what a later stage hands on: no order of the stages has every input.
    out: dict[int, Message] = {}
    count, messages = len(ranges), feed
    for c, span in enumerate(ranges[:-1]):
        stage = Stage(nn.Sequential(*build_layers(spec.factories(), span, seed, device)).train(), device)
        messages = [(*as_tensors(stage.evaluate(ts, bare, off)), off) for ts, bare, off in messages]
        out.update({mb * count + c + 1: message for mb, message in enumerate(messages)})
        del stage
    return out


# A stage's memory depends only on its own layers and action list, so the stages run one after another here;
# messages in flight, which the engine never counts, are left out.
def measure(spec: ModelSpec, inputs: Any, targets: torch.Tensor, balance: list[int], microbatches: int,
            schedule: str, checkpoint: str, optimizer: str, seed: int,
            device: torch.device | str = "cpu", offload: str = "none", virtual: int = 1) -> list[StageMemory]:
    """Every stage's memory during one step of `balance` (K x V chunks placed as the schedule says; a V's V is 2),
    M micro-batches."""
    device = torch.device(device)
    ranges = partition.stage_ranges(balance)
    placed = schedules.get(schedule).placement
    virtual = 2 if placed == "v" else virtual
    stages, count = len(ranges) // virtual, len(ranges)
    feed = feed_messages(inputs, microbatches, device)  # as the engine feeds a mini-batch
    labels = [t.to(device) for t in microbatch.scatter(targets, microbatches)]
    units = [float(spec.units(t)) if spec.units else float(t.shape[0]) for t in labels]
    weights = [u / sum(units) for u in units]
    out: list[StageMemory] = []
    # With one chunk per stage each stage's inputs are what the stage before it sent; with more they come first.
    arrived = _forwards(spec, ranges, feed, seed, device) if virtual > 1 else {}
    for s in range(stages):
        chunks = placement.chunks_of(s, stages, virtual, placed)
        indices = [i for c in chunks for i in ranges[c]]
        layers = build_layers(spec.factories(), indices, seed, device)
        module = nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(indices, layers))).to(device)
        for group in spec.tied:  # one tensor within the stage, as the engine ties it
            tie_within(module, [name for name in group if int(name.split(".", 1)[0]) in indices])
        module.train()
        meter = ActivationMeter([*module.parameters(), *module.buffers()])
        offloader = Offloader(device, meter)
        # One Stage per chunk over the same layers, as the engine builds a rank's chunks.
        parts = {c: Stage(nn.Sequential(OrderedDict((str(i), module.get_submodule(str(i))) for i in ranges[c])),
                          device, spec.loss if c == count - 1 else None, meter,
                          offloader=offloader if offload != "none" else None,
                          park_inputs=offloaded(offload, c)) for c in chunks}
        params = [p for p in module.parameters() if p.requires_grad]
        # Held through the step, as from a run's second step on; a stage without weights (a cell's combine) has none.
        opt = primed(optimizer, params) if params else None
        counter = _Counter(meter, module, device)
        actions = sched.build(schedule, s, stages, microbatches, checkpoint, virtual)
        sent = _Sent()
        stored = _Stored(counter, sched.rematerialised(actions))
        # The engine's own executor, with in-process channels: the earlier chunks' real outputs in, ones as
        # the gradients of this stage's outputs (a chunk whose neighbour is here takes it in memory).
        channels = Channels(_Received(arrived, microbatches, device), sent,
                            _Received(sent.messages, microbatches, device, ones=True, shift=1), _Sent())
        Executor(parts, channels, count, microbatches, True, feed=feed if 0 in chunks else (),
                 targets=labels if count - 1 in chunks else (), weights=weights if count - 1 in chunks else (),
                 before=stored).run(actions)
        grads_bytes = _unique_bytes([p.grad for p in params if p.grad is not None])
        if opt is not None:
            opt.step()
        state = [t for st in (opt.state.values() if opt else ()) for t in st.values() if isinstance(t, torch.Tensor)]
        out.append(StageMemory(s, indices[0], len(indices), _unique_bytes(params), grads_bytes,
                               _unique_bytes(state), stored.bytes, counter.peak(), meter.host_peak,
                               [[ranges[c].start, ranges[c].stop - 1] for c in chunks]))
        if virtual == 1:
            arrived = sent.messages
        # The next stage's allocator base must hold none of this stage's weights, gradients, graphs or inputs:
        # on a GPU each of these, freed after it, was taken from that stage's activations (K=8: most read 0 B).
        del parts, module, layers, opt, params, state, counter, stored, channels, sent, meter, offloader
        gc.collect()
    return out
