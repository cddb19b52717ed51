"""The one per-layer measurer: each layer's time and memory on a sample micro-batch."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline import context
from gpipe_cli.pipeline.alike import Outputs, alike_key, outputs_of, remade
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter, storage_key
from gpipe_cli.pipeline.stage import as_tensors, from_tensors

WARMUP_ROUNDS = 2  # untimed rounds per layer: the first backward of a layer can take ten times the next


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measured cost for one micro-batch (seconds are 0 on the meta device)."""

    forward: float          # forward building the autograd graph (a micro-batch not rematerialised)
    forward_nograd: float   # the graph-less first forward of a rematerialised micro-batch
    backward: float
    saved_bytes: int        # what autograd saves during its forward (its input included when saved)
    output_bytes: int       # what it hands to the next layer
    saved_input_bytes: int  # the part of `saved_bytes` that is its input (a stage holds its input anyway)
    params: int
    param_bytes: int
    recompute: float = 0.0  # the graph-building forward of a rematerialised micro-batch, before its backward

    @property
    def seconds(self) -> float:
        """Forward plus backward."""
        return self.forward + self.backward

    @property
    def activation_bytes(self) -> int:
        """What autograd saves during its forward."""
        return self.saved_bytes


class Profile(list[LayerProfile]):
    """Every layer's profile, in order, with the model input's bytes and the loss's profile (when asked)."""

    def __init__(self, layers: Sequence[LayerProfile] = (), input_bytes: int = 0,
                 loss: LayerProfile | None = None) -> None:
        super().__init__(layers)
        self.input_bytes = input_bytes
        self.loss = loss


def nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of the tensors (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _leaves(tensors: Sequence[torch.Tensor | None], grad: bool = True) -> list[torch.Tensor | None]:
    """What a stage receives: fresh leaves that require grad when floating (`grad`: not the model's input)."""
    return [None if t is None else t.detach().requires_grad_(grad and t.is_floating_point()) for t in tensors]


def _clock(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _backward(roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if roots:
        torch.autograd.backward(roots, grads)


def _time_layer(run: Callable[[bool], list[torch.Tensor]], repeats: int,
                device: torch.device) -> tuple[float, float, float, float]:
    """Median seconds of a layer's forward, graph-less forward, recompute and backward (`run(recomputing)`)."""
    # Each round runs one micro-batch's actions in the schedule's order, so each meets the memory and caches it
    # meets in a stage.
    rounds: list[tuple[float, float, float, float]] = []
    for i in range(repeats + WARMUP_ROUNDS):
        with torch.no_grad():
            nograd, _ = _clock(lambda: run(False), device)
        recompute, outputs = _clock(lambda: run(True), device)
        roots = [o for o in outputs if o.requires_grad]
        grads = [torch.ones_like(o) for o in roots]  # the gradient arrives made, as from the next stage
        del outputs
        bwd, _ = _clock(functools.partial(_backward, roots, grads), device)
        del roots, grads
        fwd, _ = _clock(lambda: run(False), device)  # a micro-batch kept whole: its graph, then its statistics
        if i >= WARMUP_ROUNDS:
            rounds.append((fwd, nograd, recompute, bwd))
    medians = [statistics.median(kind) for kind in zip(*rounds)]
    return medians[0], medians[1], medians[2], medians[3]


def saved_by(fn: Callable[[], Any], exclude: Sequence[torch.Tensor] = (),
             inputs: Sequence[torch.Tensor] = ()) -> tuple[int, int, Any, set[int]]:
    """Bytes autograd saves while `fn` runs (but `exclude`'s storages), those of `inputs`, its result, its storages."""
    meter = ActivationMeter(exclude)
    with meter.saved_tensors():
        result = fn()
    return meter.peak, meter.held_bytes(inputs), result, meter.held_storages()


def _profile_loss(loss: Callable[[Any], torch.Tensor], tensors: list[torch.Tensor | None], bare: bool,
                  repeats: int, device: torch.device, timed: bool) -> LayerProfile:
    """The loss as a layer without parameters: its forward and backward seconds, and what it saves."""
    def run() -> list[torch.Tensor]:
        return [loss(from_tensors(_leaves(tensors), bare))]

    # Timed as a layer is: each backward on a fresh graph, built outside the clock.
    fwd, _, _, bwd = _time_layer(lambda recomputing: run(), repeats, device) if timed else (0.0, 0.0, 0.0, 0.0)
    saved, saved_input, _, _ = saved_by(run, inputs=[t for t in tensors if t is not None])
    return LayerProfile(fwd, 0.0, bwd, saved, 0, saved_input, 0, 0)


def profile_layers(factories: Sequence[Callable[[], nn.Module]], sample: Any, seed: int = 0,
                   device: torch.device | str = "cpu", repeats: int = 3,
                   loss: Callable[[Any], torch.Tensor] | None = None) -> Profile:
    """Profile every layer in order on `sample` (the model's input for one micro-batch); `repeats=0`: memory only."""
    # `loss` (the model's output -> a scalar, its targets bound) is profiled too when given. Layers are built,
    # measured and freed one at a time, each fed the previous one's output, so the whole model is never in memory.
    device = torch.device(device)
    x, bare = as_tensors(sample)
    tensors = [t.to(device) if t is not None else None for t in x]
    timed = repeats > 0 and device.type != "meta"
    out = Profile(input_bytes=nbytes(tensors))
    charged: set[int] = set()  # storages in `tensors` that an earlier layer saved
    # On the meta device a layer built like an earlier one, fed alike, saves alike: priced once (10,000 layers).
    seen: dict[Hashable, tuple[LayerProfile, Outputs, tuple[bool, ...], bool]] = {}
    for index in range(len(factories)):
        key = alike_key(factories[index], tensors, bare, index > 0, tuple(storage_key(t) in charged for t in tensors
                        if t is not None)) if device.type == "meta" else None
        if key is not None and key in seen:
            profile, how, kept, bare = seen[key]
            out.append(profile)
            tensors = remade(how, tensors)
            charged = {storage_key(t) for t, held in zip(tensors, kept) if t is not None and held}
            continue
        (layer,) = build_layers(factories, [index], seed, device)
        layer.train()

        def run(layer: nn.Module = layer, tensors: Any = tensors, bare: bool = bare,
                recomputing: bool = False, grad: bool = True) -> tuple[list[Any], bool]:
            # As the engine runs it: layers such as dropout behave (and cost) differently outside it.
            with context.microbatch(step=0, offset=0, recomputing=recomputing):
                return as_tensors(layer(from_tensors(_leaves(tensors, grad), bare)))

        def timed_run(recomputing: bool, run: Callable[..., tuple[list[Any], bool]] = run,
                      grad: bool = index > 0) -> list[torch.Tensor]:
            return [o for o in run(recomputing=recomputing, grad=grad)[0] if o is not None]

        fwd, nograd, recompute, bwd = _time_layer(timed_run, repeats, device) if timed else (0.0, 0.0, 0.0, 0.0)
        weights = [*layer.parameters(), *layer.buffers()]
        # A tensor handed on unchanged and saved by an earlier layer too is charged to that layer alone: a stage
        # holding both saves it once, and a stage cut between them holds it as its input anyway.
        handed = [t for t in tensors if t is not None and storage_key(t) in charged]
        saved, saved_input, (outputs, bare), keys = saved_by(run, weights + handed,
                                                             [t for t in tensors if t is not None])
        made = outputs_of(tensors, outputs) if key is not None else None
        charged = {storage_key(t) for t in outputs if t is not None} & (charged | keys)
        # The next layer is fed this output without its graph, which frees what this layer saved.
        tensors = [t.detach() if t is not None else None for t in outputs]
        del outputs
        params = list(layer.parameters())
        out.append(LayerProfile(fwd, nograd, bwd, saved, nbytes(tensors), saved_input,
                                sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
                                recompute))
        if made is not None:
            seen[key] = out[-1], made, tuple(t is not None and storage_key(t) in charged for t in tensors), bare
        del layer
    if loss is not None:
        out.loss = _profile_loss(loss, tensors, bare, repeats, device, timed)
    return out
