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


def test_the_loss_is_charged_to_the_last_layer_and_leaves_it_fewer_layers():
    costs = equal_costs(4)
    costs.loss = 6.0
    # Without the loss in the last layer's cost, a heavy loss still got an even split and an overloaded last stage.
    assert costs.balance_costs("never") == [3.0, 3.0, 3.0, 9.0]
    assert costs.balance(2, "never") == [3, 1]  # stage costs 9 and 9, not 6 and 12


def test_the_loss_is_scaled_by_the_last_layers_ratio():
    costs = equal_costs(3)
    costs.loss = 1.0
    # The loss runs on the last stage, but was scaled by the first layer's ratio.
    scaled = costs.scaled([1.0, 1.0, 3.0])
    assert scaled.loss == pytest.approx(3.0)
    assert [t.forward for t in scaled.layers] == pytest.approx([1.0, 1.0, 3.0])


def test_a_stage_sends_its_last_layers_output_and_gets_back_that_outputs_gradient():
    # One layer hands the next stage 1 GB; the others, and the input, 1 byte. Forward and backward messages had
    # their sizes swapped: the first stage sent the input's size and the last the model's output size.
    timings = [LayerTiming(f"l{i}", forward=1.0, forward_nograd=1.0, backward=2.0,
                           output_bytes=10**9 if i == 1 else 1) for i in range(4)]
    costs = CostProfile(microbatch_size=1, input_bytes=1, loss=0.0, layers=timings)
    link = simulate.Link(bandwidth=1e9, latency=0.0)  # a second for the boundary's output, each way
    fast = simulate.predict(costs, 2, 1, 1, "gpipe", "never", IDEAL, balance=[2, 2])
    slow = simulate.predict(costs, 2, 1, 1, "gpipe", "never", link, balance=[2, 2])
    assert fast.step_time == pytest.approx(12.0)
    assert slow.step_time == pytest.approx(12.0 + 2 * 1.0, rel=1e-6)


def test_the_run_peak_is_the_largest_stages_peak():
    from gpipe_cli.estimate.measure import RunFigures, StageFigures

    # The headline peak was the smallest stage's: the memory a run needs is its most loaded device's.
    stages = [StageFigures(s, 2, 1.0, 1.0, 0.1, peak, 0, 0) for s, peak in enumerate((300, 900, 500))]
    assert RunFigures(3, 4, 8, [2, 2, 2], stages=stages).peak_bytes == 900
    cuda = [StageFigures(s, 2, 1.0, 1.0, 0.1, 10, 0, peak) for s, peak in enumerate((700, 400))]
    assert RunFigures(2, 4, 8, [2, 2], stages=cuda).peak_bytes == 700
