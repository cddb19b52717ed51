"""Rank layout of K pipeline stages × D data-parallel replicas, and process-group setup."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpipe_cli.pipeline import placement as placement_
from gpipe_cli.pipeline.comm import TIMEOUT_S, Transport
from gpipe_cli.pipeline.fabric import BACKWARD, FORWARD, RESULT, Fabric, Link, Ranks, TorchFabric, new_group


@dataclass(frozen=True)
class Layout:
    """Which stage and replica a rank is, and who its peers are (pure: no processes needed)."""

    stages: int
    replicas: int
    rank: int
    virtual: int = 1          # chunks per stage
    placement: str = "loop"   # which stage runs which chunk (pipeline/placement.py)

    @property
    def world_size(self) -> int:
        """K × D."""
        return self.stages * self.replicas

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.rank // self.stages

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """The global rank of a stage in a replica (this rank's replica by default)."""
        return (self.replica if replica is None else replica) * self.stages + stage

    @property
    def chunks(self) -> list[int]:
        """The chunks this rank runs, in ascending order."""
        return placement_.chunks_of(self.stage, self.stages, self.virtual, self.placement)

    @property
    def last_stage(self) -> int:
        """The stage that runs the last chunk (the loss): K - 1 in a loop, 0 in a V."""
        return placement_.last_stage(self.stages, self.virtual, self.placement)

    def owner(self, chunk: int) -> int:
        """The stage that runs `chunk`."""
        return placement_.owner(chunk, self.stages, self.placement)

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first chunk (the one fed with the inputs)."""
        return self.stage == self.owner(0)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last chunk (the one with the loss)."""
        return self.stage == self.last_stage

    def pipeline_ranks(self, replica: int | None = None) -> Ranks:
        """All stages of one replica (this rank's by default: the global gradient norm)."""
        return tuple(self.rank_of(s, replica) for s in range(self.stages))

    def replica_ranks(self, stage: int | None = None) -> Ranks:
        """All replicas of one stage (this rank's by default: the gradient sum)."""
        return tuple(self.rank_of(self.stage if stage is None else stage, r) for r in range(self.replicas))


def links(layout: Layout) -> list[Link]:
    """Every link of the job, in one order on every rank: between chunks on two stages both ways, outputs to rank 0."""
    out: list[Link] = []
    for replica in range(layout.replicas):
        for chunk in range(layout.stages * layout.virtual - 1):
            a, b = (layout.rank_of(layout.owner(c), replica) for c in (chunk, chunk + 1))
            if a != b and Link(a, b, FORWARD) not in out:
                out += [Link(a, b, FORWARD), Link(b, a, BACKWARD)]
    last = layout.rank_of(layout.last_stage, 0)
    if last != 0:
        out.append(Link(last, 0, RESULT))
    return out


@dataclass
class Topology:
    """A layout plus this rank's device and transport (its fabric reaches the other ranks)."""

    layout: Layout
    device: torch.device
    transport: Transport

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.layout.world_size > 1

    @property
    def fabric(self) -> Fabric | None:
        """The other ranks (None alone)."""
        return self.transport.fabric

    def groups(self) -> list[Ranks]:
        """Every rank set the engine reduces over, in one order for every rank."""
        layout = self.layout
        return ([layout.pipeline_ranks(r) for r in range(layout.replicas)] +
                [layout.replica_ranks(s) for s in range(layout.stages)])

    def share(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank (a collective)."""
        if self.fabric is None:
            return value
        return self.fabric.share(value, 0)


def local(device: torch.device | str = "cpu") -> Topology:
    """A single-process topology (K=1, D=1): no process groups at all."""
    device = torch.device(device)
    return Topology(Layout(1, 1, 0), device, Transport(device))


def choose_backend(backend: str = "auto") -> tuple[bool, torch.device, bool]:
    """Whether links use NCCL (else gloo), this rank's device, and whether tensors are staged through the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise ValueError("backend nccl needs CUDA GPUs, and none is visible")
        return False, torch.device("cpu"), False
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    shared = local_world > gpus  # NCCL refuses two ranks on one GPU: go through host memory
    if backend == "nccl" and shared:
        raise ValueError(f"{local_world} ranks on this node share {gpus} GPU(s); NCCL needs one GPU per rank: "
                         f"use backend gloo")
    if backend == "gloo" or shared:
        return False, device, True
    return True, device, False


def transport_timeout(stall_timeout: float | None) -> float:
    """How long a transfer may wait: 10 minutes, or twice a stall timeout set longer, which it must not cut short."""
    return TIMEOUT_S if stall_timeout is None else max(TIMEOUT_S, 2 * stall_timeout)


def init(stages: int, replicas: int = 1, backend: str = "auto", timeout: float = TIMEOUT_S,
         device: str = "auto", virtual: int = 1, placement: str = "loop") -> Topology:
    """Join the job started by torchrun (or run alone) and set up this rank's fabric (chunks placed by `placement`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != stages * replicas:
        raise ValueError(f"the job has {world} processes but partitions × data_parallel = {stages} × "
                         f"{replicas} = {stages * replicas}")
    nccl, dev, staging = choose_backend(backend)
    if device == "cpu":
        nccl, dev, staging = False, torch.device("cpu"), False
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return Topology(Layout(1, 1, 0, virtual, placement), dev, Transport(dev))
    if not dist.is_initialized():
        # With NCCL the default group has both backends, so a host tensor on it goes to gloo, never NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo",
                                timeout=datetime.timedelta(seconds=timeout), device_id=dev if nccl else None)
    bound = datetime.timedelta(seconds=timeout)
    control = new_group(backend="gloo", timeout=bound) if nccl else None
    fabric = TorchFabric(dev, nccl, control, bound)
    topo = Topology(Layout(stages, replicas, dist.get_rank(), virtual, placement), dev,
                    Transport(dev, fabric, timeout=timeout, control=control, staging=staging))
    fabric.open([], topo.groups())
    return topo
