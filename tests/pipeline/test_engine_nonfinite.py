"""Non-finite losses and gradients: every stage agrees to skip the update, rank 0 learns where it started."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import context, topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_ranges
from tests.multiproc import results, run_ranks

BAD_GRADIENT_STEP, BAD_LOSS_STEP = 1, 2


class _NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * float("nan")


class Poisoned(nn.Linear):
    """A linear layer whose backward yields NaN at one step: it and every layer before it get NaN gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        info = context.current()
        return _NaNBackward.apply(y) if info is not None and info.step == BAD_GRADIENT_STEP else y


def factories():
    return [lambda: nn.Linear(8, 16), lambda: Poisoned(16, 16), lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
            lambda: nn.Linear(16, 4)]


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    value = nn.functional.cross_entropy(out, target)
    info = context.current()
    # A non-finite loss whose gradients are finite: only the last stage can see it.
    return value + float("inf") if info is not None and info.step == BAD_LOSS_STEP else value


def steps(stages: int) -> list[dict]:
    topo = topology.init(stages) if stages > 1 else topology.local()
    balance = [4] if stages == 1 else [2, 2]
    layers = build_layers(factories(), stage_ranges(balance)[topo.layout.stage], 0)
    pipe = Pipeline(layers, topo, PipelineConfig(topo.layout.stages, balance=tuple(balance)), loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        before = [p.detach().clone() for p in pipe.parameters()]
        result = pipe.train_step(x if topo.layout.is_first else None, y if topo.layout.is_last else None,
                                 microbatches=2, step=step, optimizer=opt)
        changed = any(not torch.equal(b, p) for b, p in zip(before, pipe.parameters()))
        stats = result.stats
        out.append({"skipped": result.skipped, "updated": changed,
                    "where": stats.nonfinite() if stats is not None else None,
                    "optimizer_s": [s.optimizer for s in stats.stages] if stats is not None else None})
        pipe.zero_grad()
    pipe.close()
    return out


def check(ranks: list[list[dict]]) -> None:
    for rank in ranks:
        assert [s["skipped"] for s in rank] == [False, True, True]
        assert [s["updated"] for s in rank] == [True, False, False]  # the update never sees a bad step
    first = ranks[0]
    assert first[0]["where"] is None and first[2]["where"] is None  # a bad loss alone names no layer
    assert first[1]["where"] == (0, 1)  # the poisoned layer on stage 0, not layer 0 before it
    assert all(t > 0 for t in first[0]["optimizer_s"]) and all(t == 0 for t in first[1]["optimizer_s"])


def test_one_process_skips_bad_steps_and_names_the_layer():
    check([steps(1)])


@pytest.mark.slow
def test_every_stage_agrees_even_when_only_the_last_stage_sees_the_bad_loss():
    check(results(run_ranks(steps, 2, 2)))


def loss_of_the_second_replica(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Non-finite at BAD_LOSS_STEP on the examples of the second replica (from 4 of 8) alone."""
    value = nn.functional.cross_entropy(out, target)
    info = context.current()
    return value + float("inf") if info is not None and info.step == BAD_LOSS_STEP and info.offset >= 4 else value


def replicated(replicas: int) -> dict:
    topo = topology.init(1, replicas)
    pipe = Pipeline(build_layers(factories(), range(4), 0), topo, PipelineConfig(1, replicas=replicas, balance=(4,)),
                    loss_of_the_second_replica)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    skipped = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        lo, hi = 4 * topo.layout.replica, 4 * topo.layout.replica + 4
        result = pipe.train_step(x[lo:hi], y[lo:hi], microbatches=2, step=step, optimizer=opt, example_offset=lo)
        skipped.append(result.skipped)
        pipe.zero_grad()
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return {"skipped": skipped, "state": state}


@pytest.mark.slow
def test_a_bad_loss_on_one_replica_makes_every_replica_skip_the_step():
    # A flag kept per replica let replica 0 apply the step replica 1 skipped: the replicas' weights parted.
    first, second = results(run_ranks(replicated, 2, 2))
    assert first["skipped"] == second["skipped"] == [False, True, True]
    assert all(torch.equal(first["state"][k], second["state"][k]) for k in first["state"])
