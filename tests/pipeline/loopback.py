"""K x D ranks as threads of one process, over an in-process fabric that records what every rank posts.

The engine runs unchanged, usually on the meta device: shapes only, as an accelerator whose memory
the host cannot read, so any host read of device data or host tensor sent as device data shows.
Each rank's program (tests/pipeline/nccl_model.py) is what a GPU run would post: payload waits are stream
waits, the host waits only on the control plane and in `device.block`.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from gpipe_cli.pipeline import device as dev
from gpipe_cli.pipeline.comm import Transport
from gpipe_cli.pipeline.fabric import STREAM_NAMES, Link, Ranks, check_device
from gpipe_cli.pipeline.topology import Layout, Topology
from gpipe_cli.pipeline.wire import CommError, decode
from tests.pipeline import nccl_model as nm

TIMEOUT = 60.0
_rank = threading.local()
T = TypeVar("T")


class World:
    """The shared state of the ranks: what was sent, who met, and every rank's program."""

    def __init__(self, size: int, device: str = "meta") -> None:
        self.size, self.device = size, torch.device(device)
        self.cond = threading.Condition()
        self.programs: dict[int, list[nm.Op]] = {r: [] for r in range(size)}
        self.ids = itertools.count()
        self.sent: dict[tuple[Any, str], list[torch.Tensor]] = defaultdict(list)
        self.posted: dict[tuple[Any, str, int], int] = defaultdict(int)  # receives posted, per link/kind/rank
        self.versions: dict[int, int] = {}  # each payload sent: its version counter as it was sent
        self.meetings: dict[tuple[Any, int], dict[int, Any]] = defaultdict(dict)
        self.seq: dict[tuple[Any, int], int] = defaultdict(int)  # per (key, rank)
        self.syncs = [0] * size
        self._barrier = threading.Barrier(size)
        self._building = threading.Lock()

    def build(self, make: Callable[[], T]) -> T:
        """`make()` on one rank at a time while no rank trains: layers start from the process's one CPU generator."""
        # A rank's recompute sets that generator to its forward's state (and back): one that ran while
        # another rank seeded and initialised its layers would change that rank's starting weights.
        self._barrier.wait(TIMEOUT)
        with self._building:
            made = make()
        self._barrier.wait(TIMEOUT)
        return made

    def record(self, rank: int, op: nm.Op) -> None:
        self.programs[rank].append(op)

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(ready, timeout=TIMEOUT):
                raise CommError(f"loopback: {what} timed out")

    def meet(self, key: Any, rank: int, members: Sequence[int], value: Any, label: str = "") -> dict[int, Any]:
        """Wait until every member brought its value for this meeting; every member's value (`label`: a
        collective's kind and type, which NCCL never compares: the model does)."""
        with self.cond:
            seq = self.seq[(key, rank)]
            self.seq[(key, rank)] = seq + 1
            values = self.meetings[(key, seq)]
            values[rank] = value
            self.cond.notify_all()
        self.record(rank, nm.HostMeet(key, seq, tuple(members)) if key == "control" else
                    nm.Post(next(self.ids), key, "collective", _nbytes(value), label=label))
        self.wait_until(lambda: len(values) == len(members), f"meeting {key} #{seq} on rank {rank}")
        return values

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run fn(rank, *args) on every rank's thread; every result, or the first error."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def entry(rank: int) -> None:
            _rank.value = (self, rank)
            try:
                results[rank] = fn(rank, *args)
            except BaseException as exc:  # reported below, with the rank and where
                where = "".join(traceback.format_exception(exc)[-4:])
                errors.append(RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}\n{where}"))
                with self.cond:
                    self.cond.notify_all()

        threads = [threading.Thread(target=entry, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * 2)
        if errors:
            raise errors[0]
        return results


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def on_block(marker: dev.Marker) -> None:
    """Stands in for `device.block` on rank threads: the host waits for its device (recorded and counted)."""
    found = getattr(_rank, "value", None)
    if found is not None:
        world, rank = found
        world.syncs[rank] += 1
        world.record(rank, nm.Sync())


class _Work:
    def __init__(self, op: int, done: Callable[[], None] = lambda: None, link: Link | None = None) -> None:
        self.op, self.done, self.link = op, done, link

    def is_completed(self) -> bool:
        return False


class LoopbackFabric:
    """A rank's view of the world: the Fabric the engine talks to."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank
        self.device = self.data_device = world.device
        self._labels: dict[Link, str] = {}  # what the link's last header announced

    def open(self, links: Sequence[Link], groups: Sequence[Ranks]) -> None:
        """Nothing to create in one process."""

    def _post(self, comm: Any, role: str, tensor: torch.Tensor, peer: int, label: str) -> int:
        op = next(self.world.ids)
        self.world.record(self.rank, nm.Post(op, comm, role, _nbytes(tensor), peer, label))
        return op

    def send(self, link: Link, payload: torch.Tensor) -> _Work:
        check_device(payload, self.data_device, "data plane")
        op = self._post(link, "send", payload, link.dst, self._labels.get(link, ""))
        with self.world.cond:  # NCCL reads the buffer as the receive runs: the sender must leave it alone until then
            self.world.sent[(link, "data")].append(payload)
            self.world.versions[id(payload)] = payload._version
            self.world.cond.notify_all()
        return _Work(op)

    def recv(self, link: Link, payload: torch.Tensor) -> _Work:
        check_device(payload, self.data_device, "data plane")
        index = self.world.posted[(link, "data", self.rank)]
        op = self._post(link, "recv", payload, link.src, f"{STREAM_NAMES[link.stream]} receive #{index}")
        return self._receive(link, "data", payload, op)

    def _receive(self, link: Link, kind: str, buffer: torch.Tensor, op: int) -> _Work:
        world = self.world
        index = world.posted[(link, kind, self.rank)]
        world.posted[(link, kind, self.rank)] = index + 1
        sent = world.sent[(link, kind)]

        def done() -> None:
            world.wait_until(lambda: len(sent) > index, f"{kind} #{index} on {link}")
            if kind == "data" and sent[index]._version != world.versions[id(sent[index])]:
                raise CommError(f"loopback: data #{index} on {link} was written to by its sender before it was "
                                "received (NCCL would send what the buffer holds as the receive runs)")
            if not buffer.is_meta:
                if sent[index].numel() != buffer.numel():
                    raise CommError(f"loopback: {kind} #{index} on {link} is {sent[index].numel()} bytes, the "
                                    f"receive takes {buffer.numel()}")
                buffer.copy_(sent[index])
        return _Work(op if kind == "data" else index, done, link)

    def send_header(self, link: Link, header: torch.Tensor) -> _Work:
        check_device(header, torch.device("cpu"), "control plane")
        with self.world.cond:
            sent = self.world.sent[(link, "header")]
            self.world.record(self.rank, nm.HostSend(link, len(sent)))
            sent.append(header.clone())
            self.world.cond.notify_all()
        self._labels[link] = f"{STREAM_NAMES[link.stream]} of micro-batch {decode(header).microbatch}"
        return _Work(-1)

    def recv_header(self, link: Link, header: torch.Tensor) -> _Work:
        check_device(header, torch.device("cpu"), "control plane")
        return self._receive(link, "header", header, -1)

    def wait(self, work: _Work, data: bool, timeout: float) -> None:
        if data:
            self.world.record(self.rank, nm.StreamWait(work.op))
        elif work.link is not None:
            self.world.record(self.rank, nm.HostRecv(work.link, work.op))
        work.done()

    def all_reduce(self, tensor: torch.Tensor, ranks: Ranks) -> None:
        self._collective(tensor, ranks, lambda values: sum(values[r] for r in sorted(values)), "sum")

    def broadcast(self, tensor: torch.Tensor, src: int, ranks: Ranks) -> None:
        self._collective(tensor, ranks, lambda values: values[src], f"broadcast from {src}")

    def _collective(self, tensor: torch.Tensor, ranks: Ranks, combine: Callable[[dict[int, Any]], Any],
                    kind: str) -> None:
        check_device(tensor, self.device, "collectives")
        key = tuple(sorted(set(ranks)))
        if len(key) < 2:
            return
        # NCCL matches a sum with a broadcast, or fp16 with fp32 of the same bytes, and computes garbage: compared here.
        values = self.world.meet(key, self.rank, key, tensor if tensor.is_meta else tensor.clone(),
                                 f"{kind} of {tensor.dtype}")
        self.world.record(self.rank, nm.StreamWait(self.world.programs[self.rank][-1].op))  # type: ignore[union-attr]
        if not tensor.is_meta:
            tensor.copy_(combine(values))

    def host_sum(self, values: torch.Tensor) -> None:
        check_device(values, torch.device("cpu"), "control plane")
        met = self._control(values.clone())
        values.copy_(sum(met[r] for r in sorted(met)))

    def gather_rows(self, row: torch.Tensor) -> list[torch.Tensor] | None:
        check_device(row, torch.device("cpu"), "control plane")
        met = self._control(row.clone())
        return [met[r] for r in range(self.world.size)] if self.rank == 0 else None

    def gather_objects(self, value: Any) -> list[Any] | None:
        met = self._control(value)
        return [met[r] for r in range(self.world.size)] if self.rank == 0 else None

    def share(self, value: Any, src: int) -> Any:
        return self._control(value)[src]

    def _control(self, value: Any) -> dict[int, Any]:
        return self.world.meet("control", self.rank, range(self.world.size), value)


def topology(world: World, rank: int, stages: int, replicas: int = 1) -> Topology:
    """Rank `rank`'s topology in `world`."""
    fabric = LoopbackFabric(world, rank)
    return Topology(Layout(stages, replicas, rank), world.device, Transport(world.device, fabric, timeout=TIMEOUT))
