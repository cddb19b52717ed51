"""The cut checked in the running pipeline: stages' measured compute corrects layer costs that mispredict them."""

import time

import pytest
import torch
from torch import nn

from gpipe_cli.data import Batch
from gpipe_cli.models.base import LayerSpec, ModelSpec
from gpipe_cli.pipeline import partition, topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.train import cut as recut
from tests.multiproc import results, run_ranks

# Seconds a layer of weight 1 waits in its forward; its backward waits twice that. The cut [1, 4] beats [2, 3] while
# a sleep overshoots by under 8/3 UNIT (stage 0 sleeps 18 times a step, stage 1 12): 40 ms on a busy machine.
UNIT = 0.015


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class Slow(nn.Module):
    """A layer whose compute is a wait: `weight` units forward (and recompute), twice that backward."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight = weight
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.weight * UNIT)
        return _SlowBackward.apply(self.linear(x), 2 * self.weight * UNIT)


WEIGHTS = [4.0, 1.0, 1.0, 1.0, 1.0]  # a heavy first layer, as AmoebaNet's stem at a large image size


def slow_spec() -> ModelSpec:
    layers = [LayerSpec(f"l{i}", lambda w=w: Slow(w)) for i, w in enumerate(WEIGHTS)]
    return ModelSpec(name="slow", task="image", layers=layers, loss=lambda out, y: (out - y).square().mean(),
                     example_batch=lambda n, device: (torch.ones(n, 4, device=device), torch.zeros(n, 4)))


def trial_rank(balance: list[int]) -> list[float] | None:
    """Time trial steps of the slow model cut as `balance` on 2 ranks."""
    topo = topology.init(2)
    spec = slow_spec()
    config = PipelineConfig(2, microbatches=2, checkpoint="always", balance=tuple(balance))
    layers = build_layers(spec.factories(), partition.stage_layers(balance, 2, topo.layout.stage), 0)
    inputs, targets = spec.example_batch(4, "cpu")
    batch = Batch(index=0, size=4, offset=0, global_size=4, inputs=inputs, targets=targets)
    return recut.stage_compute(Pipeline(layers, topo, config, spec.loss), batch, 2, seed=0)


def test_refined_costs_keep_each_stage_s_shares_and_take_its_measured_sum():
    refined = recut.refined_costs([1.0, 3.0, 2.0, 2.0], [2, 2], [2.0, 8.0])
    assert refined == [0.5, 1.5, 4.0, 4.0]
    assert partition.stage_costs(refined, [2, 2]) == [2.0, 8.0]
    assert recut.imbalance([2.0, 8.0]) == 3.0 and recut.imbalance([1.0, 1.05]) == pytest.approx(0.05)
    assert recut.better(refined, [2, 2], [3, 1]) and not recut.better(refined, [2, 2], [1, 3])


def test_the_cut_to_time_moves_one_layer_off_the_slowest_stage_to_its_less_busy_neighbour():
    assert recut.shifted([2, 7], [1.7, 2.6]) == [3, 6]
    assert recut.shifted([3, 3, 3], [1.0, 3.0, 2.0]) == [4, 2, 3]
    assert recut.shifted([3, 3, 3], [1.0, 2.0, 3.0]) == [3, 4, 2]
    assert recut.shifted([1, 4], [3.0, 1.0]) is None  # the slowest stage holds one layer


def test_a_short_step_is_not_worth_trial_steps():
    assert not recut.worth_checking([0.01] * 4, [2, 2], microbatches=4)
    assert recut.worth_checking([0.1] * 4, [2, 2], microbatches=4)


@pytest.mark.slow
def test_trial_steps_in_the_pipeline_move_a_cut_the_layer_costs_got_wrong():
    # Costs that overrate the last layers (as timing them alone on a quiet rank can): they cut [3, 2].
    claimed = [4.0, 1.0, 1.0, 4.0, 4.0]
    balance = partition.balance_by_cost(claimed, 2)
    assert balance == [3, 2]
    measured, _ = results(run_ranks(trial_rank, 2, balance))
    assert measured is not None and recut.imbalance(measured) > recut.TOLERANCE  # the first stage waits less
    refined = recut.refined_costs(claimed, balance, measured)
    again = partition.balance_by_cost(refined, 2)
    assert again == [1, 4] and recut.better(refined, balance, again)  # the heavy layer alone: equal stages


def test_a_new_cut_must_promise_a_faster_slowest_stage_by_the_gain():
    refined = [1.0] * 8
    assert not recut.better(refined, [4, 4], [4, 4])  # the same: nothing gained
    assert not recut.better([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.04], [4, 4], [5, 3])  # a slower slowest stage
    assert recut.better([1.0] * 6 + [2.0, 2.0], [4, 4], [5, 3])  # 6 against 5 on the slowest stage


def test_the_first_trial_step_is_left_out_of_the_stages_compute():
    # It pays for allocator growth and the first messages: 10 s in it, then 1 s and 2 s, make a median of 1.5 s.
    from types import SimpleNamespace

    from gpipe_cli.pipeline.stats import StageStats

    seconds = iter([10.0, 1.0, 2.0])

    def train_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        busy = next(seconds)
        stage = StageStats(0, 0, step_time=busy, busy=busy, activation_peak=0, rss_peak=0, cuda_peak=0)
        return SimpleNamespace(stats=SimpleNamespace(stages=[stage]))

    pipe = SimpleNamespace(layout=SimpleNamespace(is_first=True, is_last=True, stages=1),
                           device=torch.device("cpu"), train_step=train_step)
    assert recut.stage_compute(pipe, None, 1, seed=0) == [1.5]  # type: ignore[arg-type]
