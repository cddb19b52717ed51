"""Exact accounting of the activation memory a stage holds, through autograd's saved-tensor hooks."""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies a tensor's storage: its address, or on the meta device (no data) the storage object."""
    storage = tensor.untyped_storage()
    # Meta storages have no address; the C++ storage object is shared by views, so it stands in for one.
    return storage._cdata if tensor.device.type == "meta" else storage.data_ptr()


class _Held:
    """A counted tensor; dropping the last reference uncounts it."""

    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: int) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of stored activations, deduplicated by storage."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {storage_key(p) for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0
        self.host_current = 0  # offloaded activations, waiting in host memory (pipeline/offload.py)
        self.host_peak = 0
        self.enabled = True  # off: nothing is counted, and no Python runs per saved tensor

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (parameters, buffers)."""
        self.excluded.update(storage_key(t) for t in tensors)

    def held_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the storages of `tensors` that are counted now."""
        keys = {storage_key(t) for t in tensors}
        return sum(entry[1] for key, entry in self._live.items() if key in keys)

    def held_storages(self) -> set[int]:
        """The storages counted now (by `storage_key`)."""
        return set(self._live)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak = self.current
        self.host_peak = self.host_current

    def host_hold(self, nbytes: int) -> None:
        """Count `nbytes` of activations moved to host memory (they no longer count on the device)."""
        if self.enabled:
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)

    def host_release(self, nbytes: int) -> None:
        """Uncount `nbytes` of activations leaving host memory."""
        if self.enabled:
            self.host_current = max(self.host_current - nbytes, 0)

    def hold(self, tensor: torch.Tensor) -> Any:
        """Count `tensor` until the returned handle is dropped (returns the tensor when not countable)."""
        if not self.enabled or tensor.is_sparse:
            return tensor
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if key in self.excluded or key == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(self, tensor, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current -= entry[1]

    def saved_tensors(self) -> contextlib.AbstractContextManager[Any]:
        """Count every tensor autograd saves for backward inside this block (nothing when disabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        # Detached (same storage, same version counter): a saved output must not keep its own grad_fn
        # alive, or a graph whose buffers autograd never frees (a split backward's input path) would be
        # a reference cycle that nothing collects.
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.hold(t.detach()), unwrap)


def unwrap(handle: Any) -> Any:
    """The tensor behind a handle returned by `ActivationMeter.hold` (or the tensor itself)."""
    return handle.tensor if isinstance(handle, _Held) else handle


def held(handles: Iterable[Any]) -> list[torch.Tensor | None]:
    """The tensors behind handles returned by `ActivationMeter.hold`."""
    return [unwrap(h) for h in handles]


def peak_rss_bytes() -> int:
    """The process's peak resident set size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def cuda_peak_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak since the last reset (0 off CUDA)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def reset_cuda_peak(device: torch.device) -> None:
    """Start a new CUDA allocator peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
