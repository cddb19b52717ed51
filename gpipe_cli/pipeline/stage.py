"""One stage's compute for each micro-batch: forward, recompute and backward, with rematerialization."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline import backward_split, context
from gpipe_cli.pipeline.memory import ActivationMeter, held
from gpipe_cli.pipeline.offload import Offloader, Parcel, Parked

Loss = Callable[[Any, torch.Tensor], torch.Tensor]


def as_tensors(value: Any) -> tuple[list[torch.Tensor | None], bool]:
    """A layer's output as a list of tensors, and whether it was a bare tensor."""
    if isinstance(value, torch.Tensor):
        return [value], True
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return list(value), False
    raise TypeError(f"a pipeline layer must return a tensor or a tuple of tensors (got {type(value).__name__})")


def from_tensors(tensors: Sequence[torch.Tensor | None], bare: bool) -> Any:
    """The inverse of `as_tensors`: what the next layer is given."""
    return tensors[0] if bare else tuple(tensors)


@dataclass
class _State:
    inputs: list[Any]                  # meter handles of the boundary input
    bare: bool
    offset: int
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
    outputs: list[Any] | None = None   # handles of the outputs with their graph
    target: torch.Tensor | None = None
    weight: float | torch.Tensor = 0.0
    pending: backward_split.Pending | None = None  # what the weight gradients (W) need, kept from B
    parked: Parked | None = None       # the boundary input while it waits in host memory
    parcel: Parcel | None = None       # the saved tensors, offloaded layer by layer


class Stage:
    """The layers of one stage and the per-micro-batch state of the running step."""

    def __init__(self, module: nn.Module, device: torch.device, loss: Loss | None = None,
                 meter: ActivationMeter | None = None, autocast: torch.dtype | None = None,
                 offloader: Offloader | None = None, park_inputs: bool = False) -> None:
        self.module, self.device, self.loss = module, device, loss
        self.meter = meter or ActivationMeter(module.parameters())
        self.offloader = offloader
        self.park_inputs = park_inputs and offloader is not None  # not the first chunk's: they are the mini-batch
        self.autocast = autocast
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.step = 0
        self._states: dict[int, _State] = {}
        self._layers = list(module.children())  # listed once: a forward walks them per micro-batch

    @property
    def in_flight(self) -> int:
        """Micro-batches whose backward has not run yet."""
        return len(self._states)

    def _running(self, offset: int, recomputing: bool) -> contextlib.AbstractContextManager[Any]:
        running = context.microbatch(self.step, offset, recomputing)
        return running if self.autocast is None else self._autocast(running)  # no generator in the common case

    @contextlib.contextmanager
    def _autocast(self, running: context.Running) -> Iterator[None]:
        with running, torch.autocast(self.device.type, dtype=self.autocast):
            yield

    def _run(self, inputs: Sequence[torch.Tensor | None], bare: bool, state: _State | None,
             parcel: Parcel | None = None) -> Any:
        x = from_tensors(inputs, bare)
        for i, layer in enumerate(self._layers):
            if parcel is not None:
                parcel.enter(i)
            x = layer(x)
        if self.loss is not None and state is not None and state.target is not None:
            return weighted(self.loss(x, state.target), state.weight)
        return x

    def forward(self, mb: int, inputs: Sequence[torch.Tensor | None], bare: bool, offset: int, remat: bool,
                target: torch.Tensor | None = None,
                weight: float | torch.Tensor = 0.0) -> tuple[list[torch.Tensor | None], bool]:
        """Run micro-batch `mb`; return what to send on (the last stage: its weighted loss)."""
        state = _State([self.meter.hold(t) if t is not None else None for t in inputs], bare, offset,
                       target=target, weight=weight)
        if remat:
            state.rng = (torch.get_rng_state(),
                         torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
            versions = [t._version for t in inputs if t is not None]
            with torch.no_grad(), self._running(offset, recomputing=False):
                out = self._run(inputs, bare, state)
            if versions != [t._version for t in inputs if t is not None]:  # the recompute would start from it
                raise RuntimeError("a layer changed its stage's input in place; the backward recomputes from that "
                                   "input, so with rematerialisation the layer must not (or use checkpoint: never)")
        else:
            state.parcel = self._parcel(inputs)
            with self._saving(state.parcel), self._running(offset, recomputing=False):
                out = self._run(inputs, bare, state, state.parcel)
            if state.parcel is not None:
                state.parcel.close(keep_last=False)
        tensors, out_bare = as_tensors(out)
        if not remat:
            state.outputs = [self.meter.hold(t) if t is not None else None for t in tensors]
        elif self.park_inputs:
            assert self.offloader is not None
            state.parked = self.offloader.park(held(state.inputs))
            state.inputs = []
        self._states[mb] = state
        return [None if t is None else t.detach() for t in tensors], out_bare

    def _parcel(self, inputs: Sequence[torch.Tensor | None]) -> Parcel | None:
        return None if self.offloader is None else Parcel(self.offloader, inputs)

    def _saving(self, parcel: Parcel | None) -> contextlib.AbstractContextManager[Any]:
        return self.meter.saved_tensors() if parcel is None else parcel.saving()

    def prefetch(self, mb: int) -> None:
        """Start bringing back what micro-batch `mb`'s backward needs first from host memory (nothing if none)."""
        state = self._states.get(mb)
        if state is None or self.offloader is None:
            return
        if state.parked is not None:
            self.offloader.fetch(state.parked)
        elif state.parcel is not None:
            state.parcel.fetch_last()

    def recompute(self, mb: int) -> None:
        """Rebuild micro-batch `mb`'s graph from its stored input, with the forward's RNG state."""
        state = self._states[mb]
        assert state.rng is not None, f"micro-batch {mb} was not rematerialised"
        if state.parked is not None:
            assert self.offloader is not None
            state.inputs, state.parked = self.offloader.take(state.parked), None
        cpu_rng, cuda_rng = state.rng
        devices = [self.device] if cuda_rng is not None else []
        inputs = held(state.inputs)
        state.parcel = self._parcel(inputs)
        with torch.random.fork_rng(devices=devices), self._saving(state.parcel), \
                self._running(state.offset, recomputing=True):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            out = self._run(inputs, state.bare, state, state.parcel)
        if state.parcel is not None:  # the backward comes next: its first layer stays
            state.parcel.close(keep_last=True)
        state.outputs = [self.meter.hold(t) if t is not None else None for t in as_tensors(out)[0]]

    def _roots(self, mb: int, grads: Sequence[torch.Tensor | None] | None) -> list[tuple[torch.Tensor, Any]]:
        state = self._states[mb]
        assert state.outputs is not None, f"micro-batch {mb} has no graph: recompute it first"
        outputs = held(state.outputs)
        if grads is None:  # the last stage: the output is the weighted loss
            return [(o, None) for o in outputs if o is not None and o.requires_grad]
        return [(o, g) for o, g in zip(outputs, grads) if o is not None and g is not None and o.requires_grad]

    def backward(self, mb: int, grads: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """Backpropagate micro-batch `mb` (the last stage from its loss); return its input gradients."""
        roots = self._roots(mb, grads)
        state = self._states.pop(mb)
        if roots:
            with self.meter.saved_tensors():
                torch.autograd.backward([o for o, _ in roots], [g for _, g in roots])
        if state.parcel is not None:
            state.parcel.settle()
        inputs = held(state.inputs)
        return [t.grad if t is not None and t.requires_grad else None for t in inputs]

    def backward_input(self, mb: int, grads: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """The input gradients of micro-batch `mb` alone (B); its graph stays for `backward_weight` (W)."""
        roots = self._roots(mb, grads)
        state = self._states[mb]
        inputs = held(state.inputs)
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with self.meter.saved_tensors():
            found, state.pending = backward_split.backward_input([o for o, _ in roots], [g for _, g in roots], wanted)
        if state.parcel is not None:
            state.parcel.put_away()
        by_input = dict(zip(map(id, wanted), found))
        return [by_input.get(id(t)) for t in inputs]

    def backward_weight(self, mb: int) -> None:
        """Accumulate the weight gradients of micro-batch `mb` (after its `backward_input`); free its graph."""
        state = self._states.pop(mb)
        assert state.pending is not None, f"micro-batch {mb} has no input gradient yet: run backward_input first"
        with self.meter.saved_tensors():
            backward_split.backward_weight(state.pending, self.params)
        state.pending = None
        if state.parcel is not None:
            state.parcel.settle()

    def evaluate(self, inputs: Sequence[torch.Tensor | None], bare: bool, offset: int) -> Any:
        """A no-grad forward of one micro-batch (evaluation)."""
        with torch.no_grad(), self._running(offset, recomputing=False):
            return self._run(inputs, bare, None)


def weighted(loss: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss times its share of the mini-batch."""
    # A float64 share summed on the device stands for the Python number the host would have divided: it is
    # rounded to the loss's math type and the product keeps the loss's type, as with a number.
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float64 and loss.dtype != torch.float64:
        return (loss * weight.to(torch.promote_types(loss.dtype, torch.float32))).to(loss.dtype)
    return loss * weight
