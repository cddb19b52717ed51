"""Every distributed operation of the engine, behind one small interface, checked for the device it needs."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from gpipe_cli.pipeline.wire import CommError

FORWARD, BACKWARD, RESULT = 0, 1, 2
STREAM_NAMES = {FORWARD: "activations", BACKWARD: "gradients", RESULT: "outputs"}
Ranks = tuple[int, ...]


@dataclass(frozen=True)
class Link:
    """One kind of message (`stream`) from rank `src` to rank `dst`, on a communicator of its own."""

    src: int
    dst: int
    stream: int

    @property
    def tag(self) -> int:
        """The link's headers on the control plane (gloo matches a receive by sender and tag, in order)."""
        return 10 + self.stream


class Work(Protocol):
    """A posted operation."""

    def wait(self, timeout: datetime.timedelta = ...) -> Any:
        """Wait for it (on NCCL: make the current stream wait)."""

    def is_completed(self) -> bool:
        """Whether it is done (never waits)."""


# Three planes, alike on every backend: links carry payloads on the data device, collectives (gradient sums,
# the global norm) run on the compute device, the control plane (headers, host values) is gloo on the host.
class Fabric(Protocol):
    """What the engine asks of the ranks around it."""

    data_device: torch.device  # where payloads travel from: the device for NCCL, the host for gloo

    def open(self, links: Sequence[Link], groups: Sequence[Ranks]) -> None:
        """Create communicators for these links and rank sets (every rank, same lists, same order)."""

    def send(self, link: Link, payload: torch.Tensor) -> Work:
        """Post a payload on a link."""

    def recv(self, link: Link, payload: torch.Tensor) -> Work:
        """Post a receive of exactly `payload`'s bytes on a link."""

    def send_header(self, link: Link, header: torch.Tensor) -> Work:
        """Post a header (host memory) for a link on the control plane."""

    def recv_header(self, link: Link, header: torch.Tensor) -> Work:
        """Post a receive of a link's next header on the control plane."""

    def wait(self, work: Work, data: bool, timeout: float) -> None:
        """Wait for an operation: data ones on a GPU only make the compute stream wait."""

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks) -> None:
        """Sum a compute-device tensor over `ranks` in place (queued on a GPU)."""

    def broadcast(self, tensor: torch.Tensor, src: int, ranks: Ranks) -> None:
        """Copy rank `src`'s compute-device tensor to every rank of `ranks`."""

    def host_sum(self, values: torch.Tensor) -> None:
        """Sum a host tensor over every rank in place (control plane)."""

    def gather_rows(self, row: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's host row, on rank 0 (None elsewhere)."""

    def gather_objects(self, value: Any) -> list[Any] | None:
        """Every rank's picklable value, on rank 0 (None elsewhere)."""

    def share(self, value: Any, src: int) -> Any:
        """Rank `src`'s picklable value, on every rank."""


# What NCCL reduces and moves (bool as uint8); gloo takes more, so a tensor NCCL refuses is refused on the CPU too.
NCCL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                         torch.int8, torch.uint8, torch.bool})


def check_device(tensor: torch.Tensor, device: torch.device, plane: str) -> None:
    """Refuse a tensor that is not where its plane's communicator can read it, or not as NCCL reads memory."""
    if tensor.device != device:
        raise CommError(f"a {tensor.device.type} tensor reached the {plane}, which takes {device} tensors only: "
                        f"an engine bug (a host value sent where device data belongs, or the reverse)")
    if not tensor.is_contiguous():  # gloo copes with strides; NCCL refuses them, so the CPU runs refuse them first
        raise CommError(f"a tensor of strides {tensor.stride()} reached the {plane}, which takes contiguous ones "
                        "only: an engine bug")
    if tensor.dtype not in NCCL_DTYPES:
        raise CommError(f"a {tensor.dtype} tensor reached the {plane}, a type NCCL does not carry: an engine bug")


_HOST = torch.device("cpu")


def _posted(work: Any) -> Any:
    """The handle of a posted operation (torch types it optional for ranks outside the group)."""
    if work is None:
        raise CommError("a point-to-point operation was posted by a rank outside its group")
    return work


def new_group(ranks: list[int] | None = None, **options: Any) -> dist.ProcessGroup:
    """dist.new_group, typed as torch 2.13 types it (2.14 adds the marker it returns to ranks outside the group)."""
    return cast(dist.ProcessGroup, dist.new_group(ranks, **options))


class TorchFabric(Fabric):
    """torch.distributed: gloo control plane; links on NCCL with a GPU per rank, else gloo."""

    def __init__(self, device: torch.device, nccl: bool, control: dist.ProcessGroup | None,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=600)) -> None:
        self.rank = dist.get_rank()
        # Given to every communicator: left out, NCCL's own default held links 10 minutes and the host-and-device
        # groups 30, where the run's bound was another.
        self.timeout = timeout
        self.device = device
        self.nccl = nccl
        self.data_device = device if nccl else _HOST  # the one line where backends differ in where data lives
        self.control = control
        self.links: dict[Link, dist.ProcessGroup] = {}
        self.groups: dict[Ranks, dist.ProcessGroup] = {}

    def open(self, links: Sequence[Link], groups: Sequence[Ranks]) -> None:
        for link in links:
            if link not in self.links:
                self.links[link] = new_group(sorted((link.src, link.dst)), backend="nccl" if self.nccl else "gloo",
                                             timeout=self.timeout)
        for ranks in groups:
            key = tuple(sorted(set(ranks)))
            if len(key) > 1 and key not in self.groups:
                self.groups[key] = new_group(list(key), timeout=self.timeout)  # the default group's backends

    def _link(self, link: Link) -> dist.ProcessGroup:
        group = self.links.get(link)
        if group is None:
            raise CommError(f"no communicator was opened for rank {link.src} -> {link.dst} "
                            f"({STREAM_NAMES[link.stream]})")
        return group

    def send(self, link: Link, payload: torch.Tensor) -> Work:
        check_device(payload, self.data_device, "data plane")
        return _posted(dist.isend(payload, link.dst, group=self._link(link)))

    def recv(self, link: Link, payload: torch.Tensor) -> Work:
        check_device(payload, self.data_device, "data plane")
        return _posted(dist.irecv(payload, link.src, group=self._link(link)))

    def send_header(self, link: Link, header: torch.Tensor) -> Work:
        check_device(header, _HOST, "control plane")
        return _posted(dist.isend(header, link.dst, group=self.control, tag=link.tag))

    def recv_header(self, link: Link, header: torch.Tensor) -> Work:
        check_device(header, _HOST, "control plane")
        return _posted(dist.irecv(header, link.src, group=self.control, tag=link.tag))

    def wait(self, work: Work, data: bool, timeout: float) -> None:
        if data and self.nccl:
            work.wait()  # NCCL bounds it with the group's timeout, watched by the heartbeat meanwhile
        else:
            work.wait(datetime.timedelta(seconds=timeout))

    def _group(self, ranks: Ranks) -> dist.ProcessGroup:
        group = self.groups.get(tuple(sorted(ranks)))
        if group is None:
            raise CommError(f"no communicator was opened for ranks {sorted(ranks)}")
        return group

    def _collective(self, op: Any, tensor: torch.Tensor, ranks: Ranks, **kwargs: Any) -> None:
        """Run `op` over `ranks` on the tensor, or on a host copy where gloo reads it (ranks sharing a GPU)."""
        if len(set(ranks)) < 2:
            return
        check_device(tensor, self.device, "collectives")
        staged = tensor
        if tensor.device != self.data_device and self.data_device == _HOST:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            staged.copy_(tensor, non_blocking=True)
            torch.cuda.current_stream(tensor.device).synchronize()  # gloo reads host memory now
        op(staged, group=self._group(ranks), **kwargs)
        if staged is not tensor:
            tensor.copy_(staged, non_blocking=True)

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks) -> None:
        self._collective(dist.all_reduce, tensor, ranks)

    def broadcast(self, tensor: torch.Tensor, src: int, ranks: Ranks) -> None:
        self._collective(dist.broadcast, tensor, ranks, src=src)

    def host_sum(self, values: torch.Tensor) -> None:
        check_device(values, _HOST, "control plane")
        dist.all_reduce(values, group=self.control)

    def gather_rows(self, row: torch.Tensor) -> list[torch.Tensor] | None:
        check_device(row, _HOST, "control plane")
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())] if self.rank == 0 else None
        dist.gather(row, rows, dst=0, group=self.control)
        return rows

    def gather_objects(self, value: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.control)
        return out

    def share(self, value: Any, src: int) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]
