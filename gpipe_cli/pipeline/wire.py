"""The bytes of one message between stages: a fixed-size header on the host, the tensors packed in one buffer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

HEADER_LEN = 64
ALIGN = 64  # each tensor starts at a multiple of it in the payload, so its typed view is aligned
MAGIC = 0x47504950  # "GPIP": a header that does not start with it means the streams are out of step
# Only bytes cross the wire, so any dtype travels on any backend (NCCL refuses int16 and the unsigned types wider
# than a byte, and carries bool as uint8).
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]
_ABSENT = -1
_FIXED = 8  # values before the tensors' descriptions


class CommError(RuntimeError):
    """A message that did not arrive in time or did not match the schedule."""


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to rebuild one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    """The decoded header of one message."""

    microbatch: int
    chunks: int   # micro-batches in this step, so a stage can check or learn it
    offset: int   # global index of the micro-batch's first example
    tensors: tuple[TensorMeta | None, ...]
    bare: bool = False   # the sender's layer returned a tensor, not a tuple
    payload: int = 0     # bytes of the packed tensors
    ahead: int = 0       # bytes of the receive the peer posted ahead (the first part of the payload)


def layout(metas: Sequence[TensorMeta | None]) -> tuple[list[int], int]:
    """Where each tensor starts in the packed payload, and the payload's size."""
    starts, at = [], 0
    for meta in metas:
        if meta is None:
            starts.append(-1)
            continue
        at = (at + ALIGN - 1) // ALIGN * ALIGN
        starts.append(at)
        at += meta.nbytes
    return starts, at


def meta_of(t: torch.Tensor | None, differentiable: bool) -> TensorMeta | None:
    """The description of a tensor to send (None for an absent one)."""
    if t is None:
        return None
    if t.dtype not in DTYPES:
        raise CommError(f"cannot send a tensor of dtype {t.dtype} between stages")
    return TensorMeta(t.dtype, tuple(t.shape), differentiable and t.is_floating_point())


def encode(microbatch: int, chunks: int, offset: int, metas: Sequence[TensorMeta | None], bare: bool = False,
           ahead: int = 0) -> torch.Tensor:
    """Pack a message's header into HEADER_LEN int64 values on the host."""
    # A tensor marked `requires_grad` becomes a leaf that requires grad on the receiver: the sender says so, as a
    # rematerialised forward runs without a graph and the tensor itself cannot tell.
    payload = layout(metas)[1]
    values = [MAGIC, microbatch, chunks, offset, int(bare), payload, ahead, len(metas)]
    for meta in metas:
        values += [_ABSENT] if meta is None else [DTYPES.index(meta.dtype) * 2 + int(meta.requires_grad),
                                                  len(meta.shape), *meta.shape]
    if len(values) > HEADER_LEN:
        raise CommError(f"a stage boundary carries {len(metas)} tensors with too many dimensions for "
                        f"the {HEADER_LEN}-value header")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode(header: torch.Tensor) -> Header:
    """Unpack a header produced by `encode`."""
    values = header.tolist()
    if values[0] != MAGIC:
        raise CommError("received a corrupt message header: the stages are out of step")
    microbatch, chunks, offset, bare, payload, ahead, count = values[1:_FIXED]
    at = _FIXED
    tensors: list[TensorMeta | None] = []
    for _ in range(count):
        code = values[at]
        if code == _ABSENT:
            tensors.append(None)
            at += 1
            continue
        ndim = values[at + 1]
        tensors.append(TensorMeta(DTYPES[code // 2], tuple(values[at + 2:at + 2 + ndim]), bool(code % 2)))
        at += 2 + ndim
    return Header(microbatch, chunks, offset, tuple(tensors), bool(bare), payload, ahead)


def pack(tensors: Sequence[torch.Tensor | None], size: int, device: torch.device) -> torch.Tensor:
    """The tensors' bytes at their aligned offsets in one uint8 buffer of `size` bytes on `device`."""
    # Copies are asynchronous; into host memory (ranks sharing a GPU) the buffer is pinned, and the caller waits
    # for the copies before the bytes leave.
    pinned = device.type == "cpu" and any(t is not None and t.device.type == "cuda" for t in tensors)
    buffer = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pinned)
    starts, _ = layout([meta_of(t, False) for t in tensors])
    for t, start in zip(tensors, starts):
        if t is not None and t.numel():
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[start:start + raw.numel()].copy_(raw, non_blocking=True)
    return buffer


def unpack(payload: torch.Tensor, header: Header) -> list[torch.Tensor | None]:
    """Typed views of the tensors in a packed payload (no copy)."""
    starts, _ = layout(header.tensors)
    return [None if meta is None else payload[start:start + meta.nbytes].view(meta.dtype).view(meta.shape)
            for meta, start in zip(header.tensors, starts)]
