"""Point-to-point transport of tensor tuples between neighbouring stages, with shape headers.

Every message is a fixed-size int64 header (micro-batch, example offset, dtype and shape of each
tensor) on the control group, then one payload per tensor on the data group. The receiver allocates
fresh buffers from the header, so a micro-batch of a new shape can never be read from a stale buffer.

Receiving runs on one background thread per inbound channel: it posts each receive as soon as the
previous message is in, so transfers overlap the stage's compute. (gloo only completes a receive
inside `wait()`, so polling from the compute thread would not make progress.)
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

HEADER_LEN = 64
_MAGIC = 0x47504950  # "GPIP": a header that does not start with it means the streams are out of step
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_ABSENT = -1

# One tag per stream; gloo matches receives to sends per (peer, tag) in posting order.
FORWARD, BACKWARD, RESULT = 0, 1, 2


def _tags(stream: int) -> tuple[int, int]:
    return 10 + 2 * stream, 11 + 2 * stream


def _posted(work: dist.Work | None) -> dist.Work:
    """The handle of a posted operation (torch types it optional for ranks outside the group)."""
    if work is None:
        raise CommError("a point-to-point operation was posted by a rank outside its group")
    return work


class CommError(RuntimeError):
    """A message that did not arrive in time or did not match the schedule."""


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class Header:
    """The decoded header of one message."""

    microbatch: int
    chunks: int   # micro-batches in this step, so a stage can check or learn it
    offset: int   # global index of the micro-batch's first example
    tensors: tuple[TensorMeta | None, ...]
    bare: bool = False  # the sender's layer returned a tensor, not a tuple


def encode(microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
           bare: bool = False, differentiable: bool = False) -> torch.Tensor:
    """Pack a message's header into HEADER_LEN int64 values.

    With `differentiable`, the receiver makes every floating tensor a leaf that requires grad. The
    sender cannot tell from `requires_grad`: a rematerialised forward runs without a graph.
    """
    values = [_MAGIC, microbatch, chunks, offset, int(bare), len(tensors)]
    for t in tensors:
        if t is None:
            values.append(_ABSENT)
            continue
        if t.dtype not in _DTYPES:
            raise CommError(f"cannot send a tensor of dtype {t.dtype} between stages")
        grad = differentiable and t.is_floating_point()
        values += [_DTYPES.index(t.dtype) * 2 + int(grad), t.dim(), *t.shape]
    if len(values) > HEADER_LEN:
        raise CommError(f"a stage boundary carries {len(tensors)} tensors with too many dimensions for "
                        f"the {HEADER_LEN}-value header")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode(header: torch.Tensor) -> Header:
    """Unpack a header produced by `encode`."""
    values = header.tolist()
    if values[0] != _MAGIC:
        raise CommError("received a corrupt message header: the stages are out of step")
    microbatch, chunks, offset, bare, count = values[1:6]
    at = 6
    tensors: list[TensorMeta | None] = []
    for _ in range(count):
        code = values[at]
        if code == _ABSENT:
            tensors.append(None)
            at += 1
            continue
        ndim = values[at + 1]
        shape = tuple(values[at + 2:at + 2 + ndim])
        tensors.append(TensorMeta(_DTYPES[code // 2], shape, bool(code % 2)))
        at += 2 + ndim
    return Header(microbatch, chunks, offset, tuple(tensors), bool(bare))


@dataclass
class Transport:
    """The groups and devices messages travel through.

    `control` carries headers (always gloo, CPU). `data` carries payloads: gloo with CPU tensors, or
    NCCL with device tensors. With `staging`, device tensors are copied through CPU memory (several
    ranks sharing one GPU use gloo for everything).
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

    @property
    def wire_device(self) -> torch.device:
        """Where payload buffers live while in flight."""
        return self.device if self.nccl_data else torch.device("cpu")

    def wait(self, work: dist.Work) -> None:
        """Wait for one operation, bounded by the transport's timeout."""
        if self.nccl_data:
            work.wait()  # NCCL bounds it with the process group's own timeout
        else:
            work.wait(datetime.timedelta(seconds=self.timeout))


class Outbound:
    """Messages from this stage to one neighbour, in schedule order."""

    def __init__(self, transport: Transport, peer: int, stream: int, window: int = 2) -> None:
        self.transport, self.peer = transport, peer
        self.header_tag, self.data_tag = _tags(stream)
        self.window = window
        self._pending: deque[tuple[list[dist.Work], list[torch.Tensor]]] = deque()

    def send(self, microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
             bare: bool = False, differentiable: bool = False) -> None:
        """Post a message; returns at once, keeping the tensors alive until the send completes."""
        header = encode(microbatch, chunks, offset, tensors, bare, differentiable)
        wire = [None if t is None else t.detach() if self.transport.nccl_data
                else t.detach().to("cpu").contiguous() for t in tensors]
        works = [_posted(dist.isend(header, self.peer, group=self.transport.control, tag=self.header_tag))]
        works += [_posted(dist.isend(t.contiguous(), self.peer, group=self.transport.data, tag=self.data_tag))
                  for t in wire if t is not None]
        self._pending.append((works, [header, *(t for t in wire if t is not None)]))
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
    """Messages from one neighbour, received ahead of use on a background thread."""

    def __init__(self, transport: Transport, peer: int, stream: int, name: str) -> None:
        self.transport, self.peer, self.name = transport, peer, name
        self.header_tag, self.data_tag = _tags(stream)
        self._jobs: queue.Queue[int | None] = queue.Queue()
        self._ready: queue.Queue[tuple[Header, list[torch.Tensor | None]] | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"recv-{name}", daemon=True)
        self._thread.start()

    def expect(self, count: int) -> None:
        """Start receiving the next `count` messages."""
        if count:
            self._jobs.put(count)

    def take(self, microbatch: int) -> tuple[Header, list[torch.Tensor | None]]:
        """The next message (which must be for `microbatch`): its header and its tensors on device."""
        try:
            item = self._ready.get(timeout=self.transport.timeout)
        except queue.Empty:
            raise CommError(f"no {self.name} message for micro-batch {microbatch} within "
                            f"{self.transport.timeout:.0f} s") from None
        if isinstance(item, BaseException):
            raise CommError(f"receiving {self.name} for micro-batch {microbatch} failed: {item}") from item
        header, tensors = item
        if header.microbatch != microbatch:
            raise CommError(f"expected {self.name} of micro-batch {microbatch}, got micro-batch "
                            f"{header.microbatch}: the stages run different schedules")
        if self.transport.nccl_data:
            tensors = self._receive_payload(header)
        out: list[torch.Tensor | None] = []
        for meta, t in zip(header.tensors, tensors):
            if t is not None and meta is not None:
                t = t.to(self.transport.device, non_blocking=True)
                if meta.requires_grad and t.is_floating_point():
                    t.requires_grad_(True)
            out.append(t)
        return header, out

    def close(self) -> None:
        """Stop the receiving thread once it is idle."""
        self._jobs.put(None)

    def _receive_payload(self, header: Header) -> list[torch.Tensor | None]:
        buffers: list[torch.Tensor | None] = [
            None if m is None else torch.empty(m.shape, dtype=m.dtype, device=self.transport.wire_device)
            for m in header.tensors]
        works = [_posted(dist.irecv(b, self.peer, group=self.transport.data, tag=self.data_tag))
                 for b in buffers if b is not None]
        for work in works:
            self.transport.wait(work)
        return buffers

    def _run(self) -> None:
        while (count := self._jobs.get()) is not None:
            try:
                for _ in range(count):
                    raw = torch.empty(HEADER_LEN, dtype=torch.int64)
                    self.transport.wait(_posted(dist.irecv(raw, self.peer, group=self.transport.control,
                                                           tag=self.header_tag)))
                    header = decode(raw)
                    # NCCL payloads are received on the compute thread, in the same stream order.
                    payload: list[torch.Tensor | None] = (
                        [None] * len(header.tensors) if self.transport.nccl_data
                        else self._receive_payload(header))
                    self._ready.put((header, payload))
            except BaseException as exc:  # handed to the compute thread, which raises it
                self._ready.put(exc)
