"""What a stage stores for its backward, waiting in host memory until the backward needs it."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gpipe_cli.pipeline.device import Marker, wait_on
from gpipe_cli.pipeline.memory import ActivationMeter, storage_key, unwrap


def offloaded(mode: str, chunk: int) -> bool:
    """Whether a chunk's stored boundary inputs go to host memory under an offload mode."""
    return mode == "activations" and chunk > 0  # the first chunk's are the mini-batch, held anyway: nothing freed


class Parked:
    """One micro-batch's boundary input in host memory, then on its way back once fetched."""

    __slots__ = ("host", "grads", "back", "ready")

    def __init__(self, host: list[torch.Tensor | None], grads: list[bool]) -> None:
        self.host, self.grads = host, grads
        self.back: list[Any] | None = None  # meter handles of the device copies, once fetched
        self.ready: Marker | None = None    # passed when the copy in is done


class _Block:
    """One storage a micro-batch saved (views of it are saved separately): on the device, in host memory, or both."""

    __slots__ = ("meter", "layer", "device", "host", "__weakref__")

    def __init__(self, meter: ActivationMeter, layer: int, flat: torch.Tensor) -> None:
        self.meter, self.layer = meter, layer
        self.device: Any = meter.hold(flat)     # the meter handle of the device bytes, while there are some
        self.host: torch.Tensor | None = None   # the host copy, once copied out

    def __del__(self) -> None:
        if self.host is not None:
            self.meter.host_release(self.host.nbytes)


class _Saved:
    """A saved tensor: its place in a block's storage."""

    __slots__ = ("block", "dtype", "shape", "stride", "offset")

    def __init__(self, block: _Block, tensor: torch.Tensor) -> None:
        self.block, self.dtype = block, tensor.dtype
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()

    def tensor(self) -> torch.Tensor:
        """The saved tensor, over the block's device bytes."""
        flat = unwrap(self.block.device)
        return torch.empty(0, dtype=self.dtype, device=flat.device).set_(
            flat.untyped_storage(), self.offset, self.shape, self.stride)


class Parcel:
    """One micro-batch's saved tensors on one chunk, by storage, grouped by the layer that saved each first."""

    def __init__(self, offloader: Offloader, keep: Sequence[torch.Tensor | None] = ()) -> None:
        self.offloader = offloader
        self.layer = 0
        self.layers: list[list[weakref.ref[_Block]]] = [[]]
        self.out: dict[int, Marker] = {}   # per layer: passed when its copy out is done
        # Per layer on its way in: the marker its copy passes, and the device tensors, kept until the compute
        # stream waits for it (so that no memory the copy writes goes back to the allocator before).
        self.into: dict[int, tuple[Marker, list[Any]]] = {}
        self._back: set[int] = set()       # layers brought back, whose device copies a later backward drops
        self._blocks: dict[int, _Block] = {}  # by storage, while the forward holds its device bytes
        # The stage's inputs stay where they are (the stage holds them, or they are the mini-batch).
        self._kept = {storage_key(t) for t in keep if t is not None}

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        """Autograd saves into this parcel inside this block."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _blocks_of(self, layer: int) -> list[_Block]:
        found = [r() for r in self.layers[layer]] if 0 <= layer < len(self.layers) else []
        return [b for b in found if b is not None]

    def pack(self, tensor: torch.Tensor) -> Any:
        """Autograd's pack hook: a handle for `tensor`, whose storage goes out when its layer is done."""
        meter = self.offloader.meter
        key = storage_key(tensor)
        # Kept: the stage's inputs, parameters, and what lives elsewhere already (a CPU index in a GPU model).
        if key in self._kept or key in meter.excluded or tensor.is_sparse or key == 0 \
                or tensor.device.type != self.offloader.device.type:
            return meter.hold(tensor.detach())
        block = self._blocks.get(key)
        if block is None:  # a storage seen first: whole, once, however many views of it are saved
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
            block = self._blocks[key] = _Block(meter, self.layer, flat)
            self.layers[self.layer].append(weakref.ref(block))
        return _Saved(block, tensor)

    def enter(self, layer: int) -> None:
        """The forward reaches `layer`: the one before starts going out, the one before that must be out."""
        self.layer = layer
        self.layers.extend([] for _ in range(layer + 1 - len(self.layers)))
        self._send(layer - 1)
        self._sent(layer - 2)

    def close(self, keep_last: bool) -> None:
        """The forward is done: every layer goes out (but the last if its backward comes next) and is out."""
        last = len(self.layers) - 1
        if not keep_last:
            self._send(last)
        for layer in range(last + (0 if keep_last else 1)):
            self._sent(layer)
        self._blocks.clear()

    def _send(self, layer: int) -> None:
        blocks = [b for b in self._blocks_of(layer) if b.host is None and b.device is not None]
        if not blocks:
            return
        offloader = self.offloader
        offloader.follow_compute()
        with offloader.on_side():
            for b in blocks:
                # Not recorded on the side stream: `_sent` makes the compute stream wait for this copy before
                # it lets the device bytes go, and a recorded use would hold them back until the side stream
                # reached later copies too (on a GPU, a third layer's worth in the allocator's cache).
                b.host = offloader.to_host(unwrap(b.device), record=False)
            self.out[layer] = Marker(offloader.device)
        offloader.meter.host_hold(sum(b.host.nbytes for b in blocks if b.host is not None))

    def _sent(self, layer: int) -> None:
        marker = self.out.pop(layer, None)
        if marker is not None:
            wait_on(marker, self.offloader.device)
        for b in self._blocks_of(layer):
            if b.host is not None and b.device is not None:
                # The copy has read it: the device memory may go, and its address become another storage's.
                self._blocks.pop(storage_key(unwrap(b.device)), None)
                b.device = None

    def fetch(self, layer: int) -> None:
        """Start bringing `layer`'s saved tensors back (nothing for those already on the device)."""
        blocks = [b for b in self._blocks_of(layer) if b.device is None and b.host is not None]
        if not blocks:
            return
        back, marker = self.offloader.to_device([b.host for b in blocks], record=False)
        self.into[layer] = (marker, back)
        for b, t in zip(blocks, back):
            b.device = self.offloader.meter.hold(t)
        self._back.add(layer)

    def fetch_last(self) -> None:
        """Start bringing back the layer the backward needs first."""
        self.fetch(len(self.layers) - 1)

    def unpack(self, saved: Any) -> torch.Tensor:
        """Autograd's unpack hook: the saved tensor on the device, its layer's neighbours kept or fetched."""
        if not isinstance(saved, _Saved):
            return unwrap(saved)
        layer = saved.block.layer
        # The backward runs from the last layer down: of the layers brought back, it keeps this one's neighbours.
        for other in [b for b in self._back if abs(b - layer) > 1]:
            self._back.discard(other)
            self._arrived(other)
            for b in self._blocks_of(other):
                if b.host is not None:  # the host copy stays, should a later pass (a split backward's W) need it
                    b.device = None
        self.fetch(layer)
        self.fetch(layer - 1)
        self._arrived(layer)
        return saved.tensor()

    def _arrived(self, layer: int) -> None:
        arriving = self.into.pop(layer, None)
        if arriving is not None:
            wait_on(arriving[0], self.offloader.device)

    def settle(self) -> None:
        """The compute stream waits for every copy still on its way in: the parcel's device memory may then go."""
        for layer in list(self.into):
            self._arrived(layer)

    def put_away(self) -> None:
        """B is done: the device copies of what host memory holds go (W brings back what it needs)."""
        # Kept until W, they made each micro-batch waiting for its W hold its first two layers' saved tensors.
        # What never went out (a recompute's last layer) stays: copying it out would make the compute wait.
        self.settle()
        for layer in range(len(self.layers)):
            self._sent(layer)
        self._back.clear()


class Offloader:
    """Moves stored activations to host memory and back for one device (every chunk of a stage shares it)."""

    def __init__(self, device: torch.device, meter: ActivationMeter) -> None:
        self.device, self.meter = device, meter
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def on_side(self) -> Any:
        """The side stream's context (nothing off CUDA)."""
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    def follow_compute(self) -> None:
        """Queue the side stream's next work after what the compute stream has queued (a copy reads its output)."""
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, t: torch.Tensor, record: bool = True) -> torch.Tensor:
        """A host copy of `t`, started on the side stream (call inside `on_side`)."""
        # `record` tells the allocator that the side stream reads `t`: needless where the compute stream waits for
        # the copy before `t` may go.
        # Shapes only: a meta stand-in, so that pricing a large model allocates nothing.
        host = torch.empty_like(t, device="meta" if t.device.type == "meta" else "cpu",
                                pin_memory=self._side is not None)
        if t.device.type != "meta":
            host.copy_(t.detach(), non_blocking=True)
        if self._side is not None and record:
            t.record_stream(self._side)  # the allocator must not reuse the tensor before the copy read it
        return host

    def to_device(self, hosts: Sequence[torch.Tensor | None], record: bool = True) -> tuple[list[Any], Marker]:
        """Device copies of host tensors, started on the side stream, and the marker the copies pass."""
        # `record` tells the allocator that the side stream writes them: needless where the compute stream waits first.
        # Allocated from the compute stream: memory allocated on the side stream would stay in a pool of its own,
        # which the compute stream never reuses (on an H100 the reserved peak came out 1.7x the allocated one).
        back = [None if h is None else torch.empty_like(h, device=self.device) for h in hosts]
        self.follow_compute()  # the memory may still be another tensor's for the compute queued so far
        with self.on_side():
            for h, t in zip(hosts, back):
                if h is not None and t is not None and h.device.type != "meta":
                    t.copy_(h, non_blocking=True)
                    if self._side is not None and record:
                        t.record_stream(self._side)  # dropped unused, it must outlive the copy
            return back, Marker(self.device)

    def park(self, tensors: Sequence[torch.Tensor | None]) -> Parked:
        """Copy boundary inputs to host memory; the caller drops its device copies (freed once the copy read them)."""
        self.follow_compute()
        with self.on_side():
            host = [None if t is None else self.to_host(t) for t in tensors]
        self.meter.host_hold(sum(h.nbytes for h in host if h is not None))
        return Parked(host, [t is not None and t.requires_grad for t in tensors])

    def fetch(self, parked: Parked) -> None:
        """Start copying a parked input back to the device (nothing if it is already on its way)."""
        if parked.back is not None:
            return
        back, parked.ready = self.to_device(parked.host)
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
            t = unwrap(handle)
            if t is not None:
                t.requires_grad_(grad)
        return back
