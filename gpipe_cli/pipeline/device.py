"""Time and figures from the device without making the host wait for it, but once per step."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import torch

_order = itertools.count(1)
_seen = threading.local()  # per rank thread: the newest marker this host already waited for


class Marker:
    """A point in the device's work: a CUDA event, or a host clock reading where work is synchronous."""

    __slots__ = ("event", "host", "order")

    def __init__(self, device: torch.device) -> None:
        self.event: torch.cuda.Event | None = None
        self.host = 0.0
        self.order = next(_order)
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.host = time.perf_counter()

    def seconds_to(self, later: Marker) -> float:
        """Seconds from this marker to a later one (both passed by the device: see `wait_for`)."""
        if self.event is not None and later.event is not None:
            return self.event.elapsed_time(later.event) / 1e3
        return later.host - self.host


def wait_for(marker: Marker) -> None:
    """Make sure the device passed `marker`; blocks only if neither a later waited-for marker nor the event says so."""
    if marker.order <= getattr(_seen, "order", 0) or (marker.event is not None and marker.event.query()):
        return
    _seen.order = marker.order
    block(marker)


def block(marker: Marker) -> None:
    """The host waits for the device: the one call of a step that does (tests count its calls)."""
    if marker.event is not None:
        marker.event.synchronize()


def wait_on(marker: Marker, device: torch.device) -> None:
    """Make `device`'s current stream wait for `marker` (work on another stream); the host goes on."""
    if marker.event is not None:
        torch.cuda.current_stream(device).wait_event(marker.event)


class HostCopy:
    """A device tensor's values on their way into host memory, readable once the device got there."""

    def __init__(self, values: torch.Tensor) -> None:
        device = values.device
        if device.type == "meta":  # shapes only: a stand-in accelerator whose figures read as zeros
            self._host = torch.zeros(values.shape, dtype=values.dtype)
        elif device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
        else:
            self._host = values.detach().clone()
        self.marker = Marker(device)

    def read(self) -> torch.Tensor:
        """The values on the host (waits for the device, unless it is already past the copy)."""
        wait_for(self.marker)
        return self._host


def to_device(batch: Any, device: torch.device) -> Any:
    """A host batch (a tensor or a tuple of them) on the device without blocking the host."""
    if not isinstance(batch, torch.Tensor):
        return tuple(to_device(b, device) for b in batch)
    if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)
