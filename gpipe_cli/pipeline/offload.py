"""Stored boundary inputs that wait in host memory between a micro-batch's forward and its recompute.

Under rematerialization a stage keeps one boundary input per in-flight micro-batch. With offload that
input is copied to host memory right after its forward and the device copy is dropped; it comes back
ahead of its recompute, one recompute ahead in the schedule's order (the executor asks for the next one
as each recompute ends, so the copy overlaps that micro-batch's backward).

    compute stream:  F(i) ──────────── ... R(i-1) B(i-1) ──wait ev(i)── R(i) B(i)
    side stream:          copy out(i)         copy in(i) ─ev(i)─┘

On a GPU both copies run on a side stream into and out of pinned memory: the compute stream never waits
for a copy out (the allocator is told the side stream still reads the input), and waits on an event for a
copy in, so the host waits for neither. On the CPU the same steps run without streams and the host copy
is a separate tensor; on the meta device (shapes only) nothing is copied, as in `device.HostCopy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from gpipe_cli.pipeline.device import Marker, wait_on
from gpipe_cli.pipeline.memory import ActivationMeter


def offloaded(mode: str, chunk: int) -> bool:
    """Whether a chunk's stored inputs go to host memory under an offload mode.

    Not the first chunk's: its inputs are views of the mini-batch, which the step holds to its end anyway,
    so moving them would free nothing on the device.
    """
    return mode == "activations" and chunk > 0


class Parked:
    """One micro-batch's boundary input in host memory, then on its way back once fetched."""

    __slots__ = ("host", "grads", "back", "ready")

    def __init__(self, host: list[torch.Tensor | None], grads: list[bool]) -> None:
        self.host, self.grads = host, grads
        self.back: list[Any] | None = None  # meter handles of the device copies, once fetched
        self.ready: Marker | None = None    # passed when the copy in is done


class Offloader:
    """Moves boundary inputs to host memory and back for one device (every chunk of a stage shares it)."""

    def __init__(self, device: torch.device, meter: ActivationMeter) -> None:
        self.device, self.meter = device, meter
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _on_side(self) -> Any:
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    def park(self, tensors: Sequence[torch.Tensor | None]) -> Parked:
        """Copy `tensors` to host memory; the caller drops its device copies (freed once the copy read them)."""
        if self._side is not None:  # the copy reads what the forward wrote: queued after it, not waited for
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_side():
            host = [None if t is None else self._to_host(t) for t in tensors]
        self.meter.host_hold(sum(h.nbytes for h in host if h is not None))
        return Parked(host, [t is not None and t.requires_grad for t in tensors])

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty_like(t, device="cpu", pin_memory=self._side is not None)
        if t.device.type != "meta":  # shapes only: nothing to copy
            host.copy_(t.detach(), non_blocking=True)
        if self._side is not None:
            t.record_stream(self._side)  # the allocator must not reuse the input before the copy read it
        return host

    def fetch(self, parked: Parked) -> None:
        """Start copying a parked input back to the device (nothing if it is already on its way)."""
        if parked.back is not None:
            return
        with self._on_side():
            back = [None if h is None else h.to(self.device, non_blocking=True) for h in parked.host]
            parked.ready = Marker(self.device)
        self.meter.host_release(sum(h.nbytes for h in parked.host if h is not None))
        parked.host = []
        parked.back = [None if t is None else self.meter.hold(t) for t in back]

    def take(self, parked: Parked) -> list[Any]:
        """The parked input's meter handles on the device, usable by the compute stream from now on."""
        self.fetch(parked)
        assert parked.back is not None and parked.ready is not None
        wait_on(parked.ready, self.device)
        back = parked.back
        for handle, grad in zip(back, parked.grads):
            t = getattr(handle, "tensor", handle)
            if t is None:
                continue
            if self._side is not None:  # allocated on the side stream, now used (and freed) on the compute one
                t.record_stream(torch.cuda.current_stream(self.device))
            t.requires_grad_(grad)
        return back

