"""Point-to-point transport of tensor tuples between neighbouring stages, with shape headers.

A message is a fixed-size header (micro-batch, example offset, dtype and shape of every tensor)
followed by the tensors' bytes, packed into one buffer and sent as one gloo message. Receives are
posted a few messages ahead into fresh buffers, so transfers overlap compute and a micro-batch of a
new shape can never be read from a stale buffer.

Each receive buffer has a capacity both ends agree on without talking: the largest message of all
earlier steps (gloo accepts a message smaller than the buffer). A message that does not fit, such as
the first of a run or a longer sequence, goes as its header plus one exact-size overflow message.
With NCCL the header travels over gloo and the tensors over NCCL, one message each.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpipe_cli.pipeline import heartbeat

HEADER_LEN = 64
HEADER_BYTES = HEADER_LEN * 8
_ALIGN = 64  # every tensor starts on a 64-byte boundary, so its typed view is aligned
_WINDOW = 3  # receives posted ahead per channel
_MAGIC = 0x47504950  # "GPIP": a header that does not start with it means the streams are out of step
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_ABSENT = -1

# One pair of tags per stream; gloo matches receives to sends per (peer, tag) in posting order.
FORWARD, BACKWARD, RESULT = 0, 1, 2


def _tags(stream: int) -> tuple[int, int]:
    return 10 + 2 * stream, 11 + 2 * stream


class CommError(RuntimeError):
    """A message that did not arrive in time or did not match the schedule."""


def _posted(work: dist.Work | None) -> dist.Work:
    """The handle of a posted operation (torch types it optional for ranks outside the group)."""
    if work is None:
        raise CommError("a point-to-point operation was posted by a rank outside its group")
    return work


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to rebuild one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Header:
    """The decoded header of one message."""

    microbatch: int
    chunks: int   # micro-batches in this step, so a stage can check or learn it
    offset: int   # global index of the micro-batch's first example
    tensors: tuple[TensorMeta | None, ...]
    bare: bool = False  # the sender's layer returned a tensor, not a tuple
    overflow: bool = False  # the tensors follow in a message of their own
    payload: int = 0  # bytes of the packed tensors

    @property
    def size(self) -> int:
        """Bytes of the whole message when header and tensors travel together."""
        return HEADER_BYTES + self.payload


def layout(metas: Sequence[TensorMeta | None]) -> tuple[list[int], int]:
    """Where each tensor starts in the packed payload, and the payload's size."""
    starts, at = [], 0
    for meta in metas:
        if meta is None:
            starts.append(-1)
            continue
        at = (at + _ALIGN - 1) // _ALIGN * _ALIGN
        starts.append(at)
        at += meta.nbytes
    return starts, at


def _meta(t: torch.Tensor | None, differentiable: bool) -> TensorMeta | None:
    if t is None:
        return None
    if t.dtype not in _DTYPES:
        raise CommError(f"cannot send a tensor of dtype {t.dtype} between stages")
    return TensorMeta(t.dtype, tuple(t.shape), differentiable and t.is_floating_point())


def encode(microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
           bare: bool = False, differentiable: bool = False, overflow: bool = False) -> torch.Tensor:
    """Pack a message's header into HEADER_LEN int64 values.

    With `differentiable`, the receiver makes every floating tensor a leaf that requires grad. The
    sender cannot tell from `requires_grad`: a rematerialised forward runs without a graph.
    """
    metas = [_meta(t, differentiable) for t in tensors]
    payload = layout(metas)[1]
    values = [_MAGIC, microbatch, chunks, offset, int(bare), int(overflow), payload, len(metas)]
    for meta in metas:
        if meta is None:
            values.append(_ABSENT)
        else:
            values += [_DTYPES.index(meta.dtype) * 2 + int(meta.requires_grad), len(meta.shape), *meta.shape]
    if len(values) > HEADER_LEN:
        raise CommError(f"a stage boundary carries {len(metas)} tensors with too many dimensions for "
                        f"the {HEADER_LEN}-value header")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode(header: torch.Tensor) -> Header:
    """Unpack a header produced by `encode`."""
    values = header.tolist()
    if values[0] != _MAGIC:
        raise CommError("received a corrupt message header: the stages are out of step")
    microbatch, chunks, offset, bare, overflow, payload, count = values[1:8]
    at = 8
    tensors: list[TensorMeta | None] = []
    for _ in range(count):
        code = values[at]
        if code == _ABSENT:
            tensors.append(None)
            at += 1
            continue
        ndim = values[at + 1]
        tensors.append(TensorMeta(_DTYPES[code // 2], tuple(values[at + 2:at + 2 + ndim]), bool(code % 2)))
        at += 2 + ndim
    return Header(microbatch, chunks, offset, tuple(tensors), bool(bare), bool(overflow), payload)


def pack(header: torch.Tensor, tensors: Sequence[torch.Tensor | None], with_header: bool) -> torch.Tensor:
    """The header (optionally) and the tensors' bytes in one uint8 buffer."""
    starts, payload = layout([None if t is None else TensorMeta(t.dtype, tuple(t.shape), False) for t in tensors])
    base = HEADER_BYTES if with_header else 0
    buffer = torch.empty(base + payload, dtype=torch.uint8)
    if with_header:
        buffer[:HEADER_BYTES].copy_(header.view(torch.uint8))
    for t, start in zip(tensors, starts):
        if t is not None and t.numel():
            raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[base + start:base + start + raw.numel()].copy_(raw)
    return buffer


def unpack(payload: torch.Tensor, header: Header) -> list[torch.Tensor | None]:
    """Typed views of the tensors in a packed payload (no copy)."""
    starts, _ = layout(header.tensors)
    out: list[torch.Tensor | None] = []
    for meta, start in zip(header.tensors, starts):
        if meta is None:
            out.append(None)
            continue
        out.append(payload[start:start + meta.nbytes].view(meta.dtype).view(meta.shape))
    return out


@dataclass
class Transport:
    """The groups and devices messages travel through.

    `control` carries headers (always gloo). `data` carries payloads: gloo with CPU tensors, or NCCL
    with device tensors. With `staging`, device tensors go through CPU memory and gloo (several
    ranks sharing one GPU).
    """

    device: torch.device
    control: dist.ProcessGroup | None = None
    data: dist.ProcessGroup | None = None
    staging: bool = False
    timeout: float = 600.0

    @property
    def nccl_data(self) -> bool:
        """Whether payloads travel by NCCL (device memory) rather than through host memory."""
        return self.device.type == "cuda" and not self.staging

    def wait(self, work: dist.Work) -> None:
        """Wait for one operation, bounded by the transport's timeout."""
        if self.nccl_data:
            work.wait()  # NCCL bounds it with the process group's own timeout
        else:
            work.wait(datetime.timedelta(seconds=self.timeout))
        heartbeat.tick()


class _Capacity:
    """The receive-buffer size both ends of a channel use: the largest message of all earlier steps."""

    def __init__(self) -> None:
        self.current = self._largest = HEADER_BYTES

    def begin_step(self) -> None:
        self.current = self._largest

    def observe(self, size: int) -> None:
        self._largest = max(self._largest, size)


class Outbound:
    """Messages from this stage to one neighbour, in schedule order."""

    def __init__(self, transport: Transport, peer: int, stream: int, window: int = 2) -> None:
        self.transport, self.peer = transport, peer
        self.tag, self.overflow_tag = _tags(stream)
        self.window = window
        self.capacity = _Capacity()
        self._pending: deque[tuple[list[dist.Work], list[torch.Tensor]]] = deque()

    def begin_step(self) -> None:
        """Mark a step boundary (both ends must call it, in step)."""
        self.capacity.begin_step()

    def send(self, microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
             bare: bool = False, differentiable: bool = False) -> None:
        """Post a message; returns at once, keeping the buffers alive until the send completes."""
        transport = self.transport
        size = HEADER_BYTES + layout([_meta(t, False) for t in tensors])[1]
        fits = size <= self.capacity.current and not transport.nccl_data
        self.capacity.observe(size)
        header = encode(microbatch, chunks, offset, tensors, bare, differentiable, overflow=not fits)
        if fits:
            buffers = [pack(header, tensors, with_header=True)]
            works = [_posted(dist.isend(buffers[0], self.peer, group=transport.control, tag=self.tag))]
        else:
            buffers = [header.view(torch.uint8)]
            works = [_posted(dist.isend(buffers[0], self.peer, group=transport.control, tag=self.tag))]
            if transport.nccl_data:
                buffers += [t.detach().contiguous() for t in tensors if t is not None]
                works += [_posted(dist.isend(t, self.peer, group=transport.data)) for t in buffers[1:]]
            else:
                buffers.append(pack(header, tensors, with_header=False))
                works.append(_posted(dist.isend(buffers[1], self.peer, group=transport.data, tag=self.overflow_tag)))
        self._pending.append((works, buffers))
        # The receiver posts its receives ahead, so older sends are done: reclaim their memory.
        while len(self._pending) > self.window:
            self._finish(self._pending.popleft()[0])

    def flush(self) -> None:
        """Wait until every posted message has left."""
        while self._pending:
            self._finish(self._pending.popleft()[0])

    def _finish(self, works: list[dist.Work]) -> None:
        for work in works:
            self.transport.wait(work)


class Inbound:
    """Messages from one neighbour, received into buffers posted ahead of use."""

    def __init__(self, transport: Transport, peer: int, stream: int, name: str, window: int = _WINDOW) -> None:
        self.transport, self.peer, self.name, self.window = transport, peer, name, window
        self.tag, self.overflow_tag = _tags(stream)
        self.capacity = _Capacity()
        self._remaining = 0
        self._posted: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def begin_step(self) -> None:
        """Mark a step boundary (both ends must call it, in step)."""
        self.capacity.begin_step()

    def expect(self, count: int) -> None:
        """Receive the next `count` messages."""
        self._remaining += count
        self._post()

    def _post(self) -> None:
        size = HEADER_BYTES if self.transport.nccl_data else self.capacity.current
        while self._remaining and len(self._posted) < self.window:
            buffer = torch.empty(size, dtype=torch.uint8)
            work = _posted(dist.irecv(buffer, self.peer, group=self.transport.control, tag=self.tag))
            self._posted.append((work, buffer))
            self._remaining -= 1

    def take(self, microbatch: int) -> tuple[Header, list[torch.Tensor | None]]:
        """The next message (which must be for `microbatch`): its header and its tensors on device."""
        if not self._posted:
            raise CommError(f"no {self.name} message for micro-batch {microbatch} was expected")
        work, buffer = self._posted.popleft()
        try:
            self.transport.wait(work)
        except RuntimeError as exc:
            raise CommError(f"receiving {self.name} for micro-batch {microbatch} failed: {exc}") from exc
        header = decode(buffer[:HEADER_BYTES].view(torch.int64))
        self.capacity.observe(header.size)
        if header.microbatch != microbatch:
            raise CommError(f"expected {self.name} of micro-batch {microbatch}, got micro-batch "
                            f"{header.microbatch}: the stages run different schedules")
        tensors = self._tensors(header, buffer)
        self._post()
        out: list[torch.Tensor | None] = []
        for meta, t in zip(header.tensors, tensors):
            if t is not None and meta is not None:
                t = t.to(self.transport.device, non_blocking=True)
                if meta.requires_grad:
                    t.requires_grad_(True)
            out.append(t)
        return header, out

    def _tensors(self, header: Header, buffer: torch.Tensor) -> list[torch.Tensor | None]:
        if not header.overflow:
            return unpack(buffer[HEADER_BYTES:], header)
        if self.transport.nccl_data:
            received: list[torch.Tensor | None] = [
                None if m is None else torch.empty(m.shape, dtype=m.dtype, device=self.transport.device)
                for m in header.tensors]
            for t in received:
                if t is not None:
                    self.transport.wait(_posted(dist.irecv(t, self.peer, group=self.transport.data)))
            return received
        payload = torch.empty(header.payload, dtype=torch.uint8)
        self.transport.wait(_posted(dist.irecv(payload, self.peer, group=self.transport.data, tag=self.overflow_tag)))
        return unpack(payload, header)

    def close(self) -> None:
        """Nothing to stop: receiving needs no thread of its own."""
