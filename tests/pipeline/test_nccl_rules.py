"""NCCL's rules checked on the CPU: what every rank of the real engine posts, played under NCCL's semantics.

Every schedule, K <= 4, V <= 3, M <= 8 (the V-shaped ones at M = K, 2K, 2K + 1), with uneven micro-batches,
a batch that changes size, D = 2, tied weights, deferred BatchNorm, evaluation of a batch smaller than M and
a decoding loop whose sequences grow. The ranks run as threads (tests/pipeline/loopback.py), on the CPU,
whose programs are shown equal to those of the meta device (an accelerator the host cannot read); the
programs they record are played by `nccl_model`, where a send blocks until its receive is at the
head of the peer's FIFO. The protocol of the previous release, replayed from the same runs, deadlocks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import device as dev
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.fabric import FORWARD, Link
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers
from gpipe_cli.pipeline.wire import CommError
from tests.pipeline import loopback
from tests.pipeline import nccl_model as nm
from tests.pipeline.toy import Embed, Project, token_loss

LAYERS = 12


class Pair(nn.Module):
    """Carries two tensors to the next layer (a message of two tensors)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 0.5


class Unpair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(self.lin(pair[0]) + pair[1])


class TokenNorm(nn.Module):
    """BatchNorm over the features of (batch, positions, features) (deferred in the engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def factories() -> list:
    middle = [lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh())] * 7
    return [Embed, *middle[:3], Pair, Unpair, TokenNorm, *middle[3:], Project]


TIED = [("0.embed.weight", f"{LAYERS - 1}.proj.weight")]


def balance(chunks: int) -> list[int]:
    return [len(part) for part in torch.arange(LAYERS).tensor_split(chunks)]


def tokens(size: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 11, (size, length), generator=torch.Generator().manual_seed(seed))


def job(rank: int, world: loopback.World, stages: int, replicas: int, virtual: int, schedule: str,
        microbatches: int, optimizer: bool) -> None:
    """What a rank does: two steps launched ahead of their reads, an evaluation, a decoding loop."""
    topo = loopback.topology(world, rank, stages, replicas)
    layout = topo.layout
    cut = balance(stages * virtual)
    remat = sched.REMAT_MODES[(microbatches + stages) % 3]
    config = PipelineConfig(stages, microbatches, replicas, virtual, schedule, remat, tuple(cut))
    layers = build_layers(factories(), stage_layers(cut, stages, layout.stage, config.placement), 7, world.device)
    pipe = Pipeline(layers, topo, config, token_loss, tied=TIED)
    layout = pipe.layout  # placed as the schedule says: the first and last chunks may share a stage
    opt = torch.optim.SGD(pipe.parameters() or [nn.Parameter(torch.zeros(1, device=world.device))], lr=0.1) \
        if optimizer else None

    def shard(batch: torch.Tensor) -> torch.Tensor:
        return batch.tensor_split(replicas)[layout.replica]

    pending = []
    for step, size in enumerate((19, 17)):  # uneven micro-batches, then a batch of another size
        x, y = shard(tokens(size, 6, step)), shard(tokens(size, 6, 100 + step))
        pending.append(pipe.launch_step(x if layout.is_first else None, y if layout.is_last else None,
                                        microbatches=microbatches, step=step, optimizer=opt))
        if len(pending) == 2:
            pending.pop(0).result()
        pipe.zero_grad()
    pending.pop().result()
    x, y = shard(tokens(3, 6, 7)), shard(tokens(3, 6, 8))  # fewer examples than micro-batches
    pipe.evaluate(x if layout.is_first else None, y if layout.is_last else None, microbatches=microbatches,
                  return_outputs=True)
    source = tokens(5, 6, 9)
    for length in range(1, 5):  # decoding: one evaluation per token, the sequences growing
        prefix = source[:, :length] if layout.is_first and layout.replica == 0 else source[:0, :length]
        pipe.evaluate(prefix if layout.is_first else None, microbatches=microbatches, return_outputs=True)
        if not topo.share(length < 4):
            break


def programs(stages: int, replicas: int, virtual: int, schedule: str, microbatches: int,
             optimizer: bool = True, device: str = "cpu") -> dict[int, list[nm.Op]]:
    world = loopback.World(stages * replicas, device)
    world.run(job, world, stages, replicas, virtual, schedule, microbatches, optimizer)
    return world.programs


def configurations() -> list[tuple[str, int, int]]:
    plain = [(name, k, 1) for name in ("gpipe", "1f1b", "zero-bubble") for k in (1, 2, 3, 4)]
    shaped = [(name, k, 2) for name in ("zero-bubble-v", "v-half") for k in (2, 3, 4)]
    return plain + [("interleaved", k, v) for v in (2, 3) for k in (2, 3, 4)] + shaped


@pytest.fixture(autouse=True)
def recorded_syncs(monkeypatch):
    monkeypatch.setattr(dev, "block", loopback.on_block)


@pytest.mark.parametrize(("schedule", "stages", "virtual"), configurations())
def test_every_schedule_runs_under_nccls_rules(schedule, stages, virtual):
    checked = 0
    shaped = schedules.get(schedule).placement == "v"
    for microbatches in range(1, 9):
        if shaped and microbatches not in (stages, 2 * stages, 2 * stages + 1):
            continue
        if virtual > 1 and not shaped and microbatches % stages:
            continue
        for replicas in (1, 2) if microbatches % 2 or microbatches == stages else (1,):  # D = 2 at odd M
            nm.run(programs(stages, replicas, virtual, schedule, microbatches, optimizer=microbatches % 4 < 2))
            checked += 1
    assert checked >= 3


def canonical(found: Mapping[int, Sequence[nm.Op]]) -> dict[int, list[nm.Op]]:
    """The programs with operation ids numbered in order of first appearance (ids are global counters)."""
    ids: dict[int, int] = {}

    def renumber(op: nm.Op) -> nm.Op:
        if isinstance(op, (nm.Post, nm.StreamWait)):
            return dataclasses.replace(op, op=ids.setdefault(op.op, len(ids)))
        return op
    return {rank: [renumber(op) for op in program] for rank, program in sorted(found.items())}


@pytest.mark.parametrize(("schedule", "stages", "virtual", "microbatches"),
                         [("gpipe", 2, 1, 3), ("1f1b", 2, 1, 3), ("zero-bubble", 2, 1, 3), ("interleaved", 2, 2, 2)])
def test_a_device_run_posts_exactly_what_a_cpu_run_posts(schedule, stages, virtual, microbatches):
    """On the meta device (an accelerator the host cannot read) every tensor's plane is checked, with D = 2,
    tied weights, evaluation and decoding; and it posts the very operations the CPU runs of the grid post."""
    on_device = programs(stages, 2, virtual, schedule, microbatches, device="meta")
    assert canonical(on_device) == canonical(programs(stages, 2, virtual, schedule, microbatches, device="cpu"))
    nm.run(on_device)


def legacy(found: Mapping[int, Sequence[nm.Op]]) -> dict[int, list[nm.Op]]:
    """The same runs as the previous release posted them on NCCL: one communicator per pair of ranks for
    payloads both ways, each receive posted only once its header arrived and waited at once, and a send
    waited for (by the stream) once two newer ones were posted."""
    out: dict[int, list[nm.Op]] = {}
    for rank, program in found.items():
        receives = {op.op: op for op in program if isinstance(op, nm.Post) and op.role == "recv"}
        sends: list[int] = []
        ops: list[nm.Op] = []
        for op in program:
            if isinstance(op, nm.Post) and isinstance(op.comm, Link):
                pair = frozenset((op.comm.src, op.comm.dst))
                moved = nm.Post(op.op, pair, op.role, op.nbytes, op.peer, op.label)
                if op.role == "recv":
                    receives[op.op] = moved
                    continue
                ops.append(moved)
                sends.append(op.op)
                if len(sends) > 2:
                    ops.append(nm.StreamWait(sends.pop(0)))
            elif isinstance(op, nm.StreamWait) and op.op in receives:
                ops += [receives[op.op], op]
            else:
                ops.append(op)
        out[rank] = ops
    return out


def test_the_previous_protocol_deadlocks_under_1f1b_and_the_new_one_does_not():
    found = programs(2, 1, 1, "1f1b", 4)
    nm.run(found)
    with pytest.raises(nm.Deadlock, match="rank 0.*rank 1"):
        nm.run(legacy(found))


def test_the_model_catches_a_send_cycle_and_a_swapped_size():
    a, b = frozenset((0, 1)), frozenset((0, 1))
    cycle = {0: [nm.Post(1, a, "send", 8, 1), nm.Post(2, a, "recv", 8, 1)],
             1: [nm.Post(3, b, "send", 8, 0), nm.Post(4, b, "recv", 8, 0)]}
    with pytest.raises(nm.Deadlock):
        nm.run(cycle)
    link = Link(0, 1, FORWARD)
    swapped = {0: [nm.Post(1, link, "send", 8, 1), nm.Post(2, link, "send", 16, 1)],
               1: [nm.Post(3, link, "recv", 16, 0), nm.Post(4, link, "recv", 8, 0)]}
    with pytest.raises(nm.Mismatch, match="8 bytes"):
        nm.run(swapped)
    fine = {0: [nm.Post(1, link, "send", 8, 1), nm.StreamWait(1), nm.Sync()],
            1: [nm.Post(3, link, "recv", 8, 0), nm.StreamWait(3), nm.Sync()]}
    nm.run(fine)


def test_each_link_carries_its_messages_in_one_order_at_both_ends():
    for schedule, stages, virtual in configurations():
        placement = schedules.get(schedule).placement
        for microbatches in (stages, 2 * stages):
            lists = sched.build_all(schedule, stages, microbatches, "never", virtual)
            sent: Counter = Counter()
            for stage, actions in enumerate(lists):
                pairs = ((sched.Kind.SEND_FWD, sched.Kind.RECV_FWD), (sched.Kind.SEND_BWD, sched.Kind.RECV_BWD))
                for kind, recv in pairs:
                    for peer in {sched.peer(a, stages, placement)[0] for a in actions if a.kind == kind}:
                        out = [(a.microbatch, sched.peer(a, stages, placement)[1]) for a in actions
                               if a.kind == kind and sched.peer(a, stages, placement)[0] == peer]
                        back = [(a.microbatch, a.chunk) for a in lists[peer]
                                if a.kind == recv and sched.peer(a, stages, placement)[0] == stage]
                        assert out == back, f"{schedule} K={stages} V={virtual}: stage {stage} -> {peer}"
                        sent[schedule] += 1
            assert sent[schedule] or stages == 1


def test_a_host_tensor_is_refused_before_it_reaches_a_device_communicator():
    world = loopback.World(2)
    fabric = loopback.LoopbackFabric(world, 0)
    with pytest.raises(CommError, match="cpu tensor reached the data plane"):
        fabric.send(Link(0, 1, FORWARD), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(CommError, match="cpu tensor reached the collectives"):
        fabric.all_reduce(torch.zeros(2), (0, 1))
    with pytest.raises(CommError, match="meta tensor reached the control plane"):
        fabric.host_sum(torch.zeros(2, device="meta"))


def test_a_strided_or_a_type_nccl_lacks_is_refused_on_every_plane():
    # gloo reduces a strided tensor or an int16 one; NCCL refuses both: the CPU runs would never have shown it.
    world = loopback.World(2)
    fabric = loopback.LoopbackFabric(world, 0)
    with pytest.raises(CommError, match=r"strides \(2,\) reached the collectives"):
        fabric.all_reduce(torch.zeros(8, device="meta")[::2], (0, 1))
    with pytest.raises(CommError, match="torch.int16 tensor reached the data plane, a type NCCL does not carry"):
        fabric.send(Link(0, 1, FORWARD), torch.zeros(4, dtype=torch.int16, device="meta"))
    with pytest.raises(CommError, match="torch.uint32 tensor reached the control plane"):
        fabric.host_sum(torch.zeros(2, dtype=torch.uint32))


def test_the_model_catches_collectives_of_another_kind_or_type_and_a_send_buffer_written_before_its_receive():
    both = (0, 1)
    mixed = {0: [nm.Post(1, both, "collective", 8, label="sum of torch.float32")],
             1: [nm.Post(2, both, "collective", 8, label="sum of torch.float16")]}
    with pytest.raises(nm.Mismatch, match="differs in size or kind"):
        nm.run(mixed)
    world = loopback.World(2, device="cpu")
    link = Link(0, 1, FORWARD)

    def ranks(rank: int) -> None:
        fabric = loopback.LoopbackFabric(world, rank)
        if rank == 0:
            payload = torch.ones(4, dtype=torch.uint8)
            fabric.wait(fabric.send(link, payload), True, loopback.TIMEOUT)
            payload.fill_(7)  # a buffer reused while the send is in flight: NCCL would send the 7s
            world.meet("control", 0, both, None)
        else:
            world.meet("control", 1, both, None)
            fabric.wait(fabric.recv(link, torch.empty(4, dtype=torch.uint8)), True, loopback.TIMEOUT)

    with pytest.raises(RuntimeError, match="written to by its sender before it was received"):
        world.run(ranks)


def test_the_grid_covers_every_schedule():
    assert {name for name, _, _ in configurations()} == set(sched.SCHEDULES)
    assert max(v for _, _, v in configurations()) == 3 and max(k for _, k, _ in configurations()) == 4
