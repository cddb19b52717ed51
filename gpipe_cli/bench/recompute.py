"""Activation checkpointing for the baselines, with the recomputed activations counted by our meter.

A checkpointed forward keeps no activation: saved-tensor hooks hand the graph a placeholder per tensor.
The first time backward asks for one, the forward runs again from the stored input with its RNG state
(identical dropout masks), and every tensor it saves is held through the `ActivationMeter` until the
graph lets go of its placeholder: recomputation costs and weighs what our engine's does, also under a
split backward. `torch.utils.checkpoint` keeps the recomputed tensors out of the meter's sight.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpipe_cli.pipeline.memory import ActivationMeter, held


class _Slot:
    """The graph's placeholder for one tensor a checkpointed forward would have saved."""

    __slots__ = ("frame", "value", "__weakref__")

    def __init__(self, frame: _Frame) -> None:
        self.frame, self.value = frame, None  # value: the meter's handle once recomputed


def _tensor(handle: Any) -> Any:
    return held([handle])[0]


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
            self.fn(*[_tensor(a) for a in self.args])
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
    return _tensor(slot.value)


def checkpoint(fn: Callable[..., Any], args: Sequence[Any], meter: ActivationMeter) -> Any:
    """`fn(*args)` keeping no activation; they are recomputed, and counted by `meter`, when backward needs them."""
    frame = _Frame(fn, args, meter)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        return fn(*args)
