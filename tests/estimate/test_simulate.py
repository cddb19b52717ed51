import pytest

from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile, LayerTiming
from gpipe_cli.pipeline import schedule as sched

IDEAL = simulate.Link(bandwidth=1e30, latency=0.0)


def equal_costs(layers: int = 8) -> CostProfile:
    timings = [LayerTiming(f"l{i}", forward=1.0, forward_nograd=1.0, backward=2.0, output_bytes=1000)
               for i in range(layers)]
    return CostProfile(microbatch_size=1, input_bytes=1000, loss=0.0, layers=timings)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (2, 32), (4, 4), (4, 16), (8, 32)])
def test_equal_costs_give_the_theoretical_bubble(schedule, stages, microbatches):
    costs = equal_costs()
    prediction = simulate.predict(costs, stages, microbatches, microbatches, schedule, "never", IDEAL)
    assert prediction.balance == [8 // stages] * stages
    assert prediction.bubble == pytest.approx(sched.theoretical_bubble(stages, microbatches), abs=1e-9)
    assert prediction.step_time == pytest.approx((microbatches + stages - 1) * 8 // stages * 3.0)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_zero_bubble_predicts_its_theory_and_beats_1f1b(stages, microbatches):
    costs = equal_costs()
    zero = simulate.predict(costs, stages, microbatches, microbatches, "zero-bubble", "never", IDEAL)
    one = simulate.predict(costs, stages, microbatches, microbatches, "1f1b", "never", IDEAL)
    assert zero.bubble == pytest.approx(sched.theoretical_bubble(stages, microbatches, "zero-bubble"), abs=1e-9)
    assert zero.bubble < one.bubble and zero.step_time < one.step_time


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (2, 32), (4, 16), (8, 32)])
def test_recompute_before_the_gradient_arrives_hides_part_of_the_bubble(stages, microbatches):
    # The schedule recomputes while it waits for the gradient, so rematerialization fills part of
    # the drain's idle time: the bubble is below (K-1)/(M+K-1), never above.
    costs = equal_costs()
    prediction = simulate.predict(costs, stages, microbatches, microbatches, "gpipe", "always", IDEAL)
    assert 0 < prediction.bubble < sched.theoretical_bubble(stages, microbatches)


def test_calibration_makes_the_single_device_step_match_the_measured_one():
    costs = equal_costs()
    alone = simulate.predict(costs, 1, 8, 8, "gpipe", "never", IDEAL)
    calibrated = simulate.predict(costs, 1, 8, 8, "gpipe", "never", IDEAL, measured_k1_step=2 * alone.step_time)
    assert calibrated.calibration == pytest.approx(2.0)
    assert calibrated.step_time == pytest.approx(2 * alone.step_time)


def busy(prediction) -> list[float]:
    return [sched.seconds(spans) for spans in prediction.spans]


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble-v", 2)])
def test_a_replay_with_the_stages_measured_busy_time_computes_for_exactly_that_long(schedule, virtual):
    costs = equal_costs()
    prediction = simulate.predict(costs, 2, 8, 8, schedule, "always", IDEAL, measured_k1_step=30.0, virtual=virtual)
    same = simulate.replayed(costs, prediction, busy(prediction), schedule, "always", IDEAL, virtual)
    assert same.step_time == pytest.approx(prediction.step_time)
    slower = simulate.replayed(costs, prediction, [busy(prediction)[0], 2 * busy(prediction)[1]], schedule,
                               "always", IDEAL, virtual)
    assert busy(slower) == pytest.approx([busy(prediction)[0], 2 * busy(prediction)[1]])
    assert slower.step_time > prediction.step_time


def test_a_slow_link_lengthens_the_step_and_the_bubble():
    costs = equal_costs()
    fast = simulate.predict(costs, 4, 16, 8, "gpipe", "never", IDEAL)
    slow = simulate.predict(costs, 4, 16, 8, "gpipe", "never", simulate.Link.of(1e-6, 500_000))
    assert slow.step_time > fast.step_time and slow.bubble > fast.bubble


def test_micro_batch_sizes_scale_the_costs():
    costs = equal_costs()
    one = simulate.predict(costs, 2, 8, 8, "gpipe", "never", IDEAL)
    two = simulate.predict(costs, 2, 16, 8, "gpipe", "never", IDEAL)
    assert two.step_time == pytest.approx(2 * one.step_time)
    assert two.samples_per_s == pytest.approx(one.samples_per_s)


def test_measured_costs_balance_by_the_min_max_split():
    costs = equal_costs()
    costs.layers[0] = LayerTiming("heavy", 5.0, 5.0, 10.0, 1000)
    assert costs.balance(2, "never") == [2, 6]  # stage costs 15 + 3 and 6 x 3


def test_the_measured_bubble_is_the_mean_of_the_stage_tables_idle_column():
    from gpipe_cli.estimate.measure import RunFigures, StageFigures

    stages = [StageFigures(s, 3, 2.5, 3.0, idle, 0, 0, 0) for s, idle in enumerate((0.131, 0.161))]
    # Per-step means whose median (0.185) is neither stage's: the headline must not disagree with the table.
    figures = RunFigures(2, 8, 128, [3, 3], bubbles=[0.185, 0.19, 0.12], stages=stages)
    assert abs(figures.bubble - 0.146) < 1e-12


def test_the_rate_model_spans_alone_to_all_busy_and_keeps_replicas_in_step():
    rate = simulate.rate_model(1.6, stages=2)
    assert rate(1) == pytest.approx(1.6) and rate(2) == pytest.approx(1.0)
    four = simulate.rate_model(1.6, stages=4)
    assert four(1) == pytest.approx(1.6) and four(4) == pytest.approx(1.0) and 1.0 < four(2) < 1.6
    replicas = simulate.rate_model(1.6, stages=1, replicas=2)  # data parallel alone: every rank always busy
    assert replicas(1) == pytest.approx(1.0)
    assert simulate.rate_model(1.6, stages=1)(1) == pytest.approx(1.0)
