"""The schedule registry: a schedule is its own module and one line in the registry, nothing else."""

from __future__ import annotations

import pytest

from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers
from tests.pipeline import loopback, ranks, toy
from tests.pipeline.test_engine import TOLERANCE


class FirstInFirstOut(schedules.Schedule):
    """GPipe's fill, then the backwards in the order of their forwards: another valid order of the same work."""

    name = "fifo"

    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """Every forward, then every backward, both in order."""
        return [(Kind.FWD, i, stage) for i in range(microbatches)] + \
            [(Kind.BWD, i, stage) for i in range(microbatches)]


def _train(rank: int, world: loopback.World, microbatches: int) -> dict:
    topo = loopback.topology(world, rank, 2)
    balance = [2, 3]
    layers = world.build(lambda: build_layers(toy.MODELS["ln"]["factories"](), stage_layers(balance, 2, rank),
                                              toy.SEED))
    config = PipelineConfig(2, schedule="fifo", checkpoint="never", balance=tuple(balance))
    pipe = Pipeline(layers, topo, config, toy.MODELS["ln"]["loss"])
    ranks.train(pipe, "ln", microbatches)
    return pipe.state_dict()


def test_a_schedule_added_through_the_registry_alone_trains_as_plain_training(monkeypatch):
    monkeypatch.setitem(schedules.REGISTRY, "fifo", FirstInFirstOut())
    assert "fifo" in schedules.names()
    lists = sched.build_all("fifo", 3, 4)
    sched.simulate(lists, lambda stage, action: 1.0)  # runs to the end: no stage waits for what never comes
    assert 0 < sched.theoretical_bubble(3, 4, "fifo") < 1
    for microbatches in (1, 3):
        world = loopback.World(2, "cpu")
        state = {k: v for part in world.run(_train, world, microbatches) for k, v in part.items()}
        errors = toy.relative_errors(state, toy.reference("ln", microbatches))
        assert max(errors.values()) < TOLERANCE, errors


def test_every_registered_schedule_states_its_bubble_and_its_order():
    for name in schedules.names():
        kind = schedules.get(name)
        virtual = 2 if kind.chunked else 1
        formula = kind.bubble(2, 4, 1)
        assert formula is None or formula == pytest.approx((2 - 1) / (4 + 2 - 1))
        assert 0 <= sched.theoretical_bubble(2, 4, name, virtual) < 1
        order = kind.order(0, 2, 4, virtual)
        assert {mb for k, mb, _ in order if k == Kind.FWD} == set(range(4))


def test_an_unknown_schedule_is_one_line_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown schedule 'zb': allowed are gpipe, 1f1b, interleaved, zero-bubble"):
        schedules.get("zb")
