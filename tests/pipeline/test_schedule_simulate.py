import random

import pytest

from gpipe_cli.estimate.simulate import rate_model
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.schedule import Kind, Span


def reference(lists, cost, latency, placement="loop"):
    """The plain simulation, each stage on its own clock: what the simulator must give at one speed."""
    arrival, spans = {}, [[] for _ in lists]
    cursor, clock = [0] * len(lists), [0.0] * len(lists)
    while any(c < len(s) for c, s in zip(cursor, lists)):
        progressed = False
        for s, actions in enumerate(lists):
            while cursor[s] < len(actions):
                action, start = actions[cursor[s]], clock[s]
                if action.kind in (Kind.RECV_FWD, Kind.RECV_BWD):
                    key = (s, action.kind, action.chunk, action.microbatch)
                    if key not in arrival:
                        break
                    end = max(start, arrival[key])
                elif action.kind in (Kind.SEND_FWD, Kind.SEND_BWD):
                    end = start
                    other, chunk = sched.peer(action, len(lists), placement)
                    recv = Kind.RECV_FWD if action.kind == Kind.SEND_FWD else Kind.RECV_BWD
                    arrival[(other, recv, chunk, action.microbatch)] = end + latency(s, action)
                else:
                    end = start + cost(s, action)
                spans[s].append(Span(s, action, start, end))
                clock[s], cursor[s], progressed = end, cursor[s] + 1, True
        assert progressed, "deadlock"
    return spans


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
def test_at_one_speed_each_stage_runs_on_its_own_clock(schedule, stages, microbatches, virtual, checkpoint):
    lists = sched.build_all(schedule, stages, microbatches, checkpoint, virtual)
    cost = random_costs(stages * 100 + microbatches)
    plain = reference(lists, cost, latency)
    found = sched.simulate(lists, cost, latency, rate=lambda busy: 1.0)
    assert found == sched.simulate(lists, cost, latency)
    assert [[s.action for s in stage] for stage in found] == [[s.action for s in stage] for stage in plain]
    for ours, theirs in zip(found, plain):
        for a, b in zip(ours, theirs):
            assert (a.start, a.end) == pytest.approx((b.start, b.end), abs=1e-9)


@pytest.mark.parametrize("schedule", sched.SCHEDULES)
@pytest.mark.parametrize("late", [0.0, 0.5])
def test_tied_costs_and_free_messages_give_the_reference_spans_exactly(schedule, late):
    """Costs of 1 or 2, messages free or half a unit late: stages wake each other at one instant (binary exact)."""
    shape = schedules.get(schedule)
    lists = sched.build_all(schedule, 4, 8, "except_last", 2 if shape.chunked else 1)
    rng = random.Random(late)
    drawn = {(s, a): rng.choice([1.0, 2.0]) for s, actions in enumerate(lists) for a in actions}
    cost, latency = (lambda stage, action: drawn[(stage, action)]), (lambda stage, action: late)
    assert sched.simulate(lists, cost, latency, shape.placement) == reference(lists, cost, latency, shape.placement)


def test_a_rank_computing_alone_runs_at_its_alone_speed():
    # GPipe, K=2, M=1: every action runs while the other stage waits, so the whole step is that much faster.
    lists = sched.build_all("gpipe", 2, 1, "never")
    cost = lambda stage, action: {sched.Kind.FWD: 1.0, sched.Kind.BWD: 2.0}.get(action.kind, 0.0)  # noqa: E731
    free = lambda stage, action: 0.0  # noqa: E731
    spans = sched.simulate(lists, cost, free, rate=rate_model(1.5, 2))
    assert makespan(spans) == pytest.approx(2 * 3.0 / 1.5)


def test_overlapping_compute_runs_at_the_busy_speed_and_the_rest_faster():
    # Two stages that each compute 2 s at once, then stage 1 alone 2 s more: 2 s together, then 2 / 1.5 alone.
    lists = sched.build_all("gpipe", 2, 1, "never")
    cost = lambda stage, action: 2.0 if action.kind == sched.Kind.FWD else 0.0  # noqa: E731
    free = lambda stage, action: 0.0  # noqa: E731
    spans = sched.simulate(lists, cost, free, rate=rate_model(1.5, 2))
    assert makespan(spans) == pytest.approx(2 * 2.0 / 1.5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_more_speed_alone_never_slows_a_step_and_helps_bubbly_schedules_most(schedule):
    lists = sched.build_all(schedule, 2, 4, "never")
    cost = random_costs(7)
    steps = [makespan(sched.simulate(lists, cost, latency, rate=rate_model(s, 2))) for s in (1.0, 1.2, 1.5)]
    assert steps[0] >= steps[1] >= steps[2]
