"""The host never waits for the device inside a training step, but once: counted on a stand-in accelerator.

The engine runs on the meta device, whose memory the host cannot read, as a GPU's. Every call that
would make the host wait for a GPU is counted when it touches device data: reading a value (`item`,
`tolist`, `float`, `int`, `bool`, `numpy`), a copy to the host (`cpu`, `to("cpu")`, `copy_` into a
host tensor), a blocking copy to the device, and the engine's own wait (`device.block`, an event's
synchronize on a GPU). Steps run as the training loop runs them: step t+1 is launched before step t
is read. At most one wait per step, for K = 1 and 2 under every schedule, on two stages with the
stored activations offloaded to the host, and with fp16's dynamic loss scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import device as dev
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers
from tests.pipeline import loopback
from tests.pipeline import nccl_model as nm
from tests.pipeline.test_nccl_rules import TIED, factories, tokens
from tests.pipeline.toy import token_loss

META = torch.device("meta")
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2)]


class Waits:
    """Host waits for the device, per thread (a rank)."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def add(self, what: str) -> None:
        found = getattr(loopback._rank, "value", None)
        rank = found[1] if found is not None else 0
        self.count[rank] = self.count.get(rank, 0) + 1


def _zeros_like_host(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype)


@contextlib.contextmanager
def counted(waits: Waits, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Count (and answer with zeros) every host read of meta data, and every `device.block`."""
    T = torch.Tensor

    def reading(name: str, answer: Any) -> None:
        original = getattr(T, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.is_meta:
                waits.add(name)
                return answer(self)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(T, name, read)

    reading("item", lambda t: 0)
    reading("tolist", lambda t: _zeros_like_host(t).tolist())
    reading("__float__", lambda t: 0.0)
    reading("__int__", lambda t: 0)
    reading("__bool__", lambda t: False)
    reading("numpy", lambda t: _zeros_like_host(t).numpy())
    reading("cpu", _zeros_like_host)
    original_to, original_copy = T.to, T.copy_

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        target, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if self.is_meta and target is not None and target.type == "cpu":
            waits.add("to(cpu)")
            return _zeros_like_host(self)
        if not self.is_meta and target is not None and target.type == "meta" and not non_blocking:
            waits.add("blocking copy to the device")
        return original_to(self, *args, **kwargs)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if src.is_meta and not self.is_meta:
            waits.add("copy_ to the host")
            return self.zero_()
        return original_copy(self, src, non_blocking)

    monkeypatch.setattr(T, "to", to)
    monkeypatch.setattr(T, "copy_", copy_)
    monkeypatch.setattr(dev, "block", lambda marker: waits.add("device.block"))
    yield


def steps(pipe: Pipeline, first: bool, last: bool, microbatches: int, waits: Waits, rank: int) -> list[int]:
    """Four steps as the training loop runs them; the waits of each step after the first."""
    opt = torch.optim.SGD(pipe.parameters() or [nn.Parameter(torch.zeros(1, device=META))], lr=0.1)
    per_step, pending = [], None
    for step in range(4):
        before = waits.count.get(rank, 0)
        x, y = tokens(9, 6, step), tokens(9, 6, 50 + step)
        launched = pipe.launch_step(x if first else None, y if last else None, microbatches=microbatches,
                                    step=step, max_grad_norm=1.0, optimizer=opt, measure_memory=step == 0)
        pipe.zero_grad()
        if pending is not None:
            pending.result()
        pending = launched
        if step:
            per_step.append(waits.count.get(rank, 0) - before)
    return per_step


@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
def test_one_wait_per_step_on_one_stage(schedule, virtual, monkeypatch):
    waits = Waits()
    with counted(waits, monkeypatch):
        layers = build_layers(factories(), range(12), 7, META)
        pipe = Pipeline(layers, topology.local(META), PipelineConfig(schedule=schedule, balance=(12,)), token_loss,
                        tied=TIED)
        per_step = steps(pipe, True, True, 4, waits, 0)
    assert per_step and max(per_step) <= 1, per_step


def _rank(rank: int, world: loopback.World, schedule: str, virtual: int, waits: Waits, offload: str,
          checkpoint: str) -> list[int]:
    topo = loopback.topology(world, rank, 2)
    cut = [12 // (2 * virtual)] * (2 * virtual)
    layers = build_layers(factories(), stage_layers(cut, 2, rank), 7, META)
    config = PipelineConfig(2, 4, virtual=virtual, schedule=schedule, balance=tuple(cut), offload=offload,
                            checkpoint=checkpoint)
    pipe = Pipeline(layers, topo, config, token_loss, tied=TIED)
    return steps(pipe, topo.layout.is_first, topo.layout.is_last, 4, waits, rank)


# Offload moves stored inputs (except_last) and saved tensors layer by layer (never, and the last micro-batch).
@pytest.mark.parametrize(("offload", "checkpoint"), [("none", "except_last"), ("activations", "except_last"),
                                                     ("activations", "never")])
@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
def test_one_wait_per_step_on_two_stages(schedule, virtual, offload, checkpoint, monkeypatch):
    waits = Waits()
    with counted(waits, monkeypatch):
        world = loopback.World(2)
        per_rank = world.run(_rank, world, schedule, virtual, waits, offload, checkpoint)
    for rank, per_step in enumerate(per_rank):
        assert per_step and max(per_step) <= 1, f"rank {rank}: {per_step}"


def test_the_counter_counts_what_would_wait(monkeypatch):
    waits = Waits()
    with counted(waits, monkeypatch):
        x = torch.ones(3, device=META)
        float(x.sum()), x.tolist(), x.cpu(), torch.ones(2).to(META)
        torch.ones(2).to(META, non_blocking=True)  # from pinned memory on a GPU: no wait
        dev.wait_for(dev.Marker(META))
    assert waits.count[0] == 5


def test_batchnorm_statistics_kept_or_left_out_add_no_wait(monkeypatch):
    # Whether a step's statistics fold into the running averages (not if it was skipped) is decided on the device.
    waits = Waits()
    with counted(waits, monkeypatch):
        layers = build_layers([lambda: nn.Linear(6, 8), lambda: nn.BatchNorm1d(8), lambda: nn.Linear(8, 11)],
                              range(3), 7, META)
        pipe = Pipeline(layers, topology.local(META), PipelineConfig(balance=(3,)), nn.CrossEntropyLoss())
        assert pipe.batchnorms
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        per_step, pending = [], None
        for step in range(4):
            before = waits.count.get(0, 0)
            launched = pipe.launch_step(tokens(8, 6, step).float(), tokens(8, 1, 50 + step)[:, 0], microbatches=4,
                                        step=step, optimizer=opt)
            pipe.zero_grad()
            if pending is not None:
                pending.result()
            pending = launched
            if step:
                per_step.append(waits.count.get(0, 0) - before)
    assert per_step and max(per_step) <= 1, per_step


@pytest.mark.parametrize("stages", [1, 2])
def test_fp16_loss_scaling_adds_no_wait(stages, monkeypatch):
    # Autocast refuses the meta device; what fp16 adds to a step is the loss scale, its overflow test and its
    # update, and those run here as on a GPU: autocast's casts stand aside.
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())
    waits = Waits()

    def rank(rank: int, world: loopback.World | None) -> list[int]:
        topo = loopback.topology(world, rank, 2) if world is not None else topology.local(META)
        cut = (12,) if world is None else (6, 6)
        layers = build_layers(factories(), stage_layers(list(cut), len(cut), rank), 7, META)
        pipe = Pipeline(layers, topo, PipelineConfig(len(cut), 4, balance=cut), token_loss, tied=TIED,
                        precision="fp16")
        assert pipe.loss_scale.enabled
        return steps(pipe, topo.layout.is_first, topo.layout.is_last, 4, waits, rank)

    with counted(waits, monkeypatch):
        if stages == 1:
            per_rank = [rank(0, None)]
        else:
            world = loopback.World(2)
            per_rank = world.run(rank, world)
    for r, per_step in enumerate(per_rank):
        assert per_step and max(per_step) <= 1, f"rank {r}: {per_step}"


def test_replicas_meet_on_the_device_alone_inside_a_step(monkeypatch):
    # Each step's units are summed over the replicas by their last stages' device collective: no host meets another
    # inside a step, and the host still waits once.
    waits, inside = Waits(), {}

    def rank(r: int, world: loopback.World) -> list[int]:
        topo = loopback.topology(world, r, 2, 2)
        layers = build_layers(factories(), stage_layers([6, 6], 2, topo.layout.stage), 7, META)
        pipe = Pipeline(layers, topo, PipelineConfig(2, 4, 2, balance=(6, 6)), token_loss, tied=TIED)
        launch = pipe.launch_step

        def recorded(*args: Any, **kwargs: Any) -> Any:
            start = len(world.programs[r])
            launched = launch(*args, **kwargs)
            inside.setdefault(r, []).extend(world.programs[r][start:])
            return launched
        monkeypatch.setattr(pipe, "launch_step", recorded)
        return steps(pipe, topo.layout.is_first, topo.layout.is_last, 4, waits, r)

    with counted(waits, monkeypatch):
        world = loopback.World(4)
        per_rank = world.run(rank, world)
    for r, per_step in enumerate(per_rank):
        assert per_step and max(per_step) <= 1, f"rank {r}: {per_step}"
        assert not [op for op in inside[r] if isinstance(op, nm.HostMeet)], f"rank {r} met on the host"
