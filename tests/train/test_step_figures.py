"""A step's figures add up: every stage's parts sum to the step time, and the bubble lies in [0, 1]."""

import pytest

from gpipe_cli.pipeline.stats import PARTS, StageStats, StepStats
from gpipe_cli.train.sinks import scalars
from gpipe_cli.train.step_figures import step_figures
from tests.train.test_view import train_record


def stage(index, step_time, busy, wait, comm, optimizer, replica=0):
    return StageStats(index, replica, step_time=step_time, busy=busy, activation_peak=1, rss_peak=2, cuda_peak=0,
                      wait=wait, comm=comm, optimizer=optimizer)


def step(*stages):
    return StepStats(loss=1.0, examples=32, units=32, step_time=max(s.step_time for s in stages), bubble_theory=0.111,
                     grad_norm=1.0, stages=list(stages))


def assert_adds_up(figures, stages):
    assert list(figures.parts) == list(PARTS)
    for s in range(stages):
        assert all(figures.parts[part][s] >= 0 for part in PARTS)
        assert sum(figures.parts[part][s] for part in PARTS) == pytest.approx(figures.seconds, rel=1e-12)
    assert 0.0 <= figures.bubble <= 1.0 and 0.0 <= figures.idle <= 1.0


def test_a_first_step_whose_stage_spent_longer_than_the_loops_wall_time_still_adds_up():
    # As recorded once after a timed cut, M=8: stage 1's parts came to 0.82 s against a 0.192 s step, bubble 1.876.
    stats = step(stage(0, 0.19, busy=0.12, wait=0.03, comm=0.02, optimizer=0.01),
                 stage(1, 0.83, busy=0.15, wait=0.62, comm=0.04, optimizer=0.01))
    figures = step_figures(stats, wall=0.192)
    assert figures.seconds == 0.83  # the step lasted as long as its longest stage spent in it
    assert_adds_up(figures, 2)
    assert figures.parts["wait"] == [0.03, 0.62]  # what each stage measured, unchanged
    assert figures.bubble == pytest.approx((0.03 + 0.62) / 2 / 0.83)


def test_in_steady_state_the_wall_time_is_the_step_and_the_loops_own_work_is_other():
    stats = step(stage(0, 0.18, busy=0.1, wait=0.05, comm=0.01, optimizer=0.005),
                 stage(1, 0.17, busy=0.12, wait=0.01, comm=0.03, optimizer=0.005))
    figures = step_figures(stats, wall=0.2)
    assert figures.seconds == 0.2
    assert_adds_up(figures, 2)
    assert figures.parts["other"] == pytest.approx([0.2 - 0.165, 0.2 - 0.165])


def test_overlapping_spans_are_scaled_into_the_step_keeping_their_proportions():
    # A reduction on another stream while the device computes: the spans add up to more than the stage's step.
    stats = step(stage(0, 0.5, busy=0.4, wait=0.0, comm=0.3, optimizer=0.1))
    figures = step_figures(stats, wall=0.3)
    assert figures.seconds == 0.5
    assert_adds_up(figures, 1)
    assert figures.parts["compute"][0] / figures.parts["comm"][0] == pytest.approx(0.4 / 0.3)
    assert figures.parts["other"] == [0.0]


def test_the_parts_of_a_step_add_up_to_its_time_in_stage_order_and_are_never_negative():
    stats = step(stage(1, 1.0, 0.5, 0.3, 0.1, 0.05), stage(0, 1.0, 0.6, 0.2, 0.1, 0.05))
    parts = step_figures(stats, wall=1.0).parts
    assert list(parts) == list(PARTS)
    assert parts["compute"] == [0.6, 0.5]  # stage order
    for s in range(2):
        assert sum(p[s] for p in parts.values()) == pytest.approx(1.0)
    short = step(stage(1, 0.5, 0.5, 0.3, 0.1, 0.05), stage(0, 0.5, 0.6, 0.2, 0.1, 0.05))
    assert step_figures(short, wall=0.5).parts["other"] == [0.0, 0.0]  # never negative


def test_a_tied_weights_gradient_sum_is_waiting_but_for_the_transfer_every_holder_spends():
    # The quick start ties its embedding (stage 0) to its softmax (stage 1). Stage 1 ended its backward first and
    # waited in the sum for stage 0's: that drain read as communication (at M=1, bubble 0.367 against 0.473 untied).
    first, middle, last = (stage(0, 0.2, busy=0.1, wait=0.05, comm=0.01, optimizer=0.0),
                           stage(1, 0.2, busy=0.1, wait=0.02, comm=0.01, optimizer=0.0),
                           stage(2, 0.2, busy=0.1, wait=0.01, comm=0.01, optimizer=0.0))
    first.shared, last.shared = 0.004, 0.05  # stage 0 came last to the sum: its time there is the transfer
    figures = step_figures(step(first, middle, last), wall=0.2)
    assert_adds_up(figures, 3)
    assert figures.parts["wait"] == pytest.approx([0.05, 0.02, 0.01 + 0.046])
    assert figures.parts["comm"] == pytest.approx([0.014, 0.01, 0.014])


def test_every_replica_bounds_the_step_but_the_first_replicas_parts_are_shown():
    stats = step(stage(0, 0.2, 0.1, 0.05, 0.01, 0.0), stage(1, 0.2, 0.1, 0.05, 0.01, 0.0),
                 stage(0, 0.4, 0.1, 0.25, 0.01, 0.0, replica=1), stage(1, 0.2, 0.1, 0.05, 0.01, 0.0, replica=1))
    figures = step_figures(stats, wall=0.25)
    assert figures.seconds == 0.4 and len(figures.parts["compute"]) == 2
    assert_adds_up(figures, 2)


def test_a_warm_up_steps_timing_goes_to_its_own_section_in_tensorboard_and_wandb():
    record = {**train_record(step=1), "warmup": True}
    tags = scalars(record)
    assert "train_warmup/samples_per_s" in tags and "train_warmup/bubble" in tags
    assert "train_warmup/time_s/wait/stage1" in tags
    assert "train/samples_per_s" not in tags and "train/bubble" not in tags and "train/warmup" not in tags
    assert "train/loss" in tags and "train/lr" in tags  # the step's training figures are as any step's
    steady = scalars(train_record(step=2))
    assert "train/samples_per_s" in steady and not any(tag.startswith("train_warmup/") for tag in steady)
