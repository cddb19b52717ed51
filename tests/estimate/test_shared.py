import random

import pytest

from gpipe_cli.estimate import shared
from gpipe_cli.pipeline import schedule as sched


def random_costs(seed: int):
    rng, drawn = random.Random(seed), {}

    def cost(stage, action):
        return drawn.setdefault((stage, action), rng.uniform(0.5, 2.0)) if action.kind in sched.COMPUTE else 0.0
    return cost


def latency(stage, action):
    return 0.1


def makespan(spans) -> float:
    return max(span.end for stage in spans for span in stage)


CASES = [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("zero-bubble", 4, 8, 1), ("interleaved", 2, 4, 2),
         ("interleaved", 4, 8, 2), ("gpipe", 3, 5, 1)]


@pytest.mark.parametrize("schedule,stages,microbatches,virtual", CASES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_at_one_speed_it_is_the_schedule_simulator(schedule, stages, microbatches, virtual, checkpoint):
    lists = sched.build_all(schedule, stages, microbatches, checkpoint, virtual)
    cost = random_costs(stages * 100 + microbatches)
    plain = sched.simulate(lists, cost, latency)
    found = shared.simulate(lists, cost, latency, lambda busy: 1.0)
    assert [[s.action for s in stage] for stage in found] == [[s.action for s in stage] for stage in plain]
    for ours, theirs in zip(found, plain):
        for a, b in zip(ours, theirs):
            assert (a.start, a.end) == pytest.approx((b.start, b.end), abs=1e-9)


def test_a_rank_computing_alone_runs_at_its_alone_speed():
    # GPipe, K=2, M=1: every action runs while the other stage waits, so the whole step is that much faster.
    lists = sched.build_all("gpipe", 2, 1, "never")
    cost = lambda stage, action: {sched.Kind.FWD: 1.0, sched.Kind.BWD: 2.0}.get(action.kind, 0.0)  # noqa: E731
    free = lambda stage, action: 0.0  # noqa: E731
    spans = shared.simulate(lists, cost, free, shared.rate_model(1.5, 2))
    assert makespan(spans) == pytest.approx(2 * 3.0 / 1.5)


def test_overlapping_compute_runs_at_the_busy_speed_and_the_rest_faster():
    # Two stages that each compute 2 s at once, then stage 1 alone 2 s more: 2 s together, then 2 / 1.5 alone.
    lists = sched.build_all("gpipe", 2, 1, "never")
    cost = lambda stage, action: 2.0 if action.kind == sched.Kind.FWD else 0.0  # noqa: E731
    free = lambda stage, action: 0.0  # noqa: E731
    spans = shared.simulate(lists, cost, free, shared.rate_model(1.5, 2))
    assert makespan(spans) == pytest.approx(2 * 2.0 / 1.5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_more_speed_alone_never_slows_a_step_and_helps_bubbly_schedules_most(schedule):
    lists = sched.build_all(schedule, 2, 4, "never")
    cost = random_costs(7)
    steps = [makespan(shared.simulate(lists, cost, latency, shared.rate_model(s, 2))) for s in (1.0, 1.2, 1.5)]
    assert steps[0] >= steps[1] >= steps[2]


def test_the_rate_model_spans_alone_to_all_busy_and_keeps_replicas_in_step():
    rate = shared.rate_model(1.6, stages=2)
    assert rate(1) == pytest.approx(1.6) and rate(2) == pytest.approx(1.0)
    four = shared.rate_model(1.6, stages=4)
    assert four(1) == pytest.approx(1.6) and four(4) == pytest.approx(1.0) and 1.0 < four(2) < 1.6
    replicas = shared.rate_model(1.6, stages=1, replicas=2)  # data parallel alone: every rank always busy
    assert replicas(1) == pytest.approx(1.0)
    assert shared.rate_model(1.6, stages=1)(1) == pytest.approx(1.0)
