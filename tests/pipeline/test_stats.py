"""Where a step's time goes: compute, waiting, communication, optimizer and what is left."""

import dataclasses
import time

import pytest
import torch

from gpipe_cli.pipeline import stats
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers
from gpipe_cli.pipeline.schedule import Action, Kind, seconds
from tests.pipeline import loopback, toy


def stage(index, busy, wait, comm, optimizer, layer=-1):
    return stats.StageStats(index, 0, step_time=1.0, busy=busy, activation_peak=1, rss_peak=2, cuda_peak=0,
                            wait=wait, comm=comm, optimizer=optimizer, nonfinite_layer=layer)


def test_the_first_bad_layer_in_backward_order_is_the_highest():
    step = stats.StepStats(loss=1.0, examples=8, units=8, step_time=1.0, bubble_theory=0.2, grad_norm=1.0,
                           stages=[stage(0, 0.5, 0, 0, 0, layer=2), stage(1, 0.5, 0, 0, 0, layer=5),
                                   stage(2, 0.5, 0, 0, 0)])
    assert step.nonfinite() == (1, 5)
    step.stages = [stage(0, 0.5, 0, 0, 0)]
    assert step.nonfinite() is None


def test_the_timeline_splits_receives_sends_and_spans():
    timeline = stats.Timeline(0, torch.device("cpu"))
    timeline.start()
    for kind in (Kind.RECV_FWD, Kind.FWD, Kind.SEND_FWD):
        timeline.begin(Action(kind, 0))
        time.sleep(0.01)
        timeline.end()
    with timeline.span(stats.OPTIMIZER):
        time.sleep(0.01)
    times = timeline.finish()
    events = times.events()
    wait, comm, optimizer = times.parts(events)
    assert min(wait, comm, optimizer, seconds(events)) >= 0.01
    assert times.step_time >= wait + comm + optimizer + seconds(events)
    mine = stage(0, seconds(events), wait, comm, optimizer, layer=3)
    gathered = stats.gather(mine, 1.0, 8, 8.0, 1.0, 0.2, None)
    assert gathered is not None
    assert gathered.stages[0].wait == pytest.approx(wait) and gathered.stages[0].nonfinite_layer == 3
    assert all(type(getattr(gathered.stages[0], f)) is int for f in ("stage", "activation_peak", "nonfinite_layer"))


@pytest.mark.parametrize(("model", "holders"), [("tied", [True, True]), ("ln", [False, False])])
def test_a_tied_weights_gradient_sum_is_timed_apart_on_its_holders(model, holders):
    # The sum waits on the holder that finished its backward first: rank 0 tells waiting from sending by the
    # holders' figures together (train/step_figures), so it must not be counted as communication here.
    world = loopback.World(2, "cpu")

    def rank(r: int) -> float:
        spec = toy.MODELS[model]
        topo = loopback.topology(world, r, 2)
        cut = [2, 2] if model == "tied" else [3, 2]
        layers = build_layers(spec["factories"](), stage_layers(cut, 2, r), toy.SEED, "cpu")
        pipe = Pipeline(layers, topo, PipelineConfig(2, 2, balance=tuple(cut)), spec["loss"], tied=spec["tied"])
        x, y = toy.batch(model, 0, 8)
        result = pipe.train_step(x if r == 0 else None, y if r == 1 else None, step=0)
        assert result.own is not None
        return result.own.shared

    assert [seconds > 0 for seconds in world.run(rank)] == holders


def test_the_gradient_norms_collective_counts_as_waiting():
    # The norm's collective is where a stage that finished early waits for the slowest: the bubble's drain.
    timeline = stats.Timeline(0, torch.device("cpu"))
    timeline.start()
    with timeline.span(stats.WAIT):
        time.sleep(0.02)
    times = timeline.finish()
    wait, comm, optimizer = times.parts(times.events())
    assert wait >= 0.02 and comm < 0.02 and optimizer == 0.0


class _TwoRanks:
    """A fabric stand-in for rank 0 of two: the other rank's row comes from `other`."""

    def __init__(self, other: stats.StageStats) -> None:
        self.other = other

    def gather_rows(self, row):
        return [row, torch.tensor([*dataclasses.astuple(self.other), 0.0, 0, 0.0], dtype=torch.float64)]


def test_the_gathered_step_lasts_as_long_as_its_slowest_rank():
    mine, other = stage(0, 0.5, 0, 0, 0), stage(1, 0.5, 0, 0, 0)
    mine.step_time, other.step_time = 1.0, 3.0
    gathered = stats.gather(mine, 1.0, 8, 8.0, 1.0, 0.2, _TwoRanks(other))
    assert gathered is not None and gathered.step_time == 3.0 and [s.stage for s in gathered.stages] == [0, 1]
