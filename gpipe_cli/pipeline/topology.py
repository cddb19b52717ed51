"""Rank layout of K pipeline stages × D data-parallel replicas, and process-group setup.

    rank = replica * K + stage

Stages of one pipeline are consecutive ranks, so with torchrun's usual placement a pipeline stays
inside a node (activations cross fast links every micro-batch) and replicas span nodes (gradients
cross the network once per mini-batch). Example, K=4, D=2, two nodes of 4 GPUs:

    node 0: ranks 0 1 2 3 = replica 0, stages 0..3
    node 1: ranks 4 5 6 7 = replica 1, stages 0..3
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpipe_cli.pipeline.comm import Transport


@dataclass(frozen=True)
class Layout:
    """Which stage and replica a rank is, and who its peers are (pure: no processes needed)."""

    stages: int
    replicas: int
    rank: int

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
    def is_first(self) -> bool:
        """Whether this rank runs the first stage."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (the one with the loss)."""
        return self.stage == self.stages - 1

    def pipeline_ranks(self, replica: int) -> list[int]:
        """All stages of one replica."""
        return [self.rank_of(s, replica) for s in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """All replicas of one stage."""
        return [self.rank_of(stage, r) for r in range(self.replicas)]


@dataclass
class Topology:
    """A layout plus the live process groups and device of this rank."""

    layout: Layout
    device: torch.device
    transport: Transport
    pipeline_group: dist.ProcessGroup | None = None   # this replica's stages (global grad norm)
    replica_group: dist.ProcessGroup | None = None    # this stage's replicas (gradient all-reduce)
    last_stages_group: dist.ProcessGroup | None = None  # the last stage of every replica (token counts)
    groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.layout.world_size > 1

    def group(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """The process group of exactly these ranks (created up front by `init`)."""
        return self.groups.get(tuple(sorted(ranks)))

    def share(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank (a collective)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.transport.control)
        return box[0]


def local(device: torch.device | str = "cpu") -> Topology:
    """A single-process topology (K=1, D=1): no process groups at all."""
    device = torch.device(device)
    return Topology(Layout(1, 1, 0), device, Transport(device))


def choose_backend(backend: str = "auto") -> tuple[str, torch.device, bool]:
    """The backend, this rank's device, and whether tensors are staged through the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend '{backend}': allowed are auto, gloo, nccl")
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise ValueError("backend nccl needs CUDA GPUs, and none is visible")
        return "gloo", torch.device("cpu"), False
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    shared = local_world > gpus  # NCCL refuses two ranks on one GPU: go through host memory
    if backend == "nccl" and shared:
        raise ValueError(f"{local_world} ranks on this node share {gpus} GPU(s); NCCL needs one GPU per rank: "
                         f"use backend gloo")
    if backend == "gloo" or shared:
        return "gloo", device, True
    return "nccl", device, False


def init(stages: int, replicas: int = 1, backend: str = "auto", timeout: float = 600.0,
         device: str = "auto") -> Topology:
    """Join the job started by torchrun (or run alone) and create every group the engine needs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != stages * replicas:
        raise ValueError(f"the job has {world} processes but partitions × data_parallel = {stages} × "
                         f"{replicas} = {stages * replicas}")
    name, dev, staging = choose_backend(backend)
    if device == "cpu":
        name, dev, staging = "gloo", torch.device("cpu"), False
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return local(dev)
    if not dist.is_initialized():
        dist.init_process_group(name, timeout=datetime.timedelta(seconds=timeout),
                                device_id=dev if name == "nccl" else None)
    layout = Layout(stages, replicas, dist.get_rank())
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout)) \
        if name == "nccl" else None
    topo = Topology(layout, dev, Transport(dev, control=control, data=None, staging=staging, timeout=timeout))
    # Every rank must create every group, in the same order, even the groups it is not in.
    wanted = [layout.pipeline_ranks(r) for r in range(replicas)]
    wanted += [layout.replica_ranks(s) for s in range(stages)]
    wanted.append([layout.rank_of(stages - 1, r) for r in range(replicas)])
    for ranks in wanted:
        key = tuple(sorted(ranks))
        if key not in topo.groups and len(ranks) > 1:
            topo.groups[key] = dist.new_group(ranks=list(key))
    topo.pipeline_group = topo.group(layout.pipeline_ranks(layout.replica))
    topo.replica_group = topo.group(layout.replica_ranks(layout.stage))
    topo.last_stages_group = topo.group([layout.rank_of(stages - 1, r) for r in range(replicas)])
    return topo


def add_groups(topo: Topology, rank_sets: list[list[int]]) -> None:
    """Create extra groups (e.g. for parameters shared across stages); every rank must call this."""
    for ranks in rank_sets:
        key = tuple(sorted(set(ranks)))
        if len(key) > 1 and key not in topo.groups:
            topo.groups[key] = dist.new_group(ranks=list(key))
