import dataclasses
import itertools
import math
import random

import pytest

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile, LayerTiming
from gpipe_cli.memory_model import Affine, LayerFigures, ModelFigures
from gpipe_cli.pipeline import partition
from gpipe_cli.pipeline.schedule import REMAT_MODES, SCHEDULES, theoretical_bubble
from gpipe_cli.plan import search

SHAPED = {"zero-bubble-v", "v-half"}
FAST = simulate.Link(1e9, 1e-6)


def synthetic(layers: int, seed: int, batch: int = 8, equal: bool = False) -> search.Model:
    """Random per-layer costs affine in the micro-batch size (a fixed part per call) and random memory."""
    rng = random.Random(seed)
    fixed = [0.0 if equal else rng.uniform(0.0, 0.3) for _ in range(layers)]
    per = [1.0 if equal else rng.uniform(0.2, 2.0) for _ in range(layers)]
    out = [1000 if equal else rng.randint(100, 5000) for _ in range(layers)]

    def costs(size: int) -> CostProfile:
        timings = [LayerTiming(f"l{i}", fixed[i] + per[i] * size, 0.9 * (fixed[i] + per[i] * size),
                               2 * (fixed[i] + per[i] * size), out[i] * size) for i in range(layers)]
        return CostProfile(size, 500 * size, 0.0 if equal else 0.1 * size, timings)

    figures = ModelFigures(Affine(0.0, 500.0), tuple(
        LayerFigures(f"l{i}", rng.randint(1000, 100000), Affine(50.0, rng.uniform(1000, 20000)),
                     Affine(0.0, float(out[i])), Affine(0.0, 0.0)) for i in range(layers)))
    return search.Model(costs, figures, 16.0, batch, action_overhead=0.0 if equal else 0.05,
                        step_overhead=0.0 if equal else 0.5)


def brute_force(model: search.Model, hw: search.Hardware) -> tuple[float, search.Config] | None:
    """Every K, M, schedule, V, remat mode and offload the long way; the balance by trying every contiguous cut."""
    best: tuple[float, search.Config] | None = None
    n = model.layers
    for k in range(1, hw.devices + 1):
        if hw.devices % k or k > n:
            continue
        d = hw.devices // k
        if model.batch % d:
            continue
        per_replica = model.batch // d
        for m in range(1, per_replica + 1):
            if per_replica % m:
                continue
            for name, v, mode, offload in itertools.product(SCHEDULES, (1, 2, 4), REMAT_MODES, ("none", "activations")):
                if name in SHAPED:
                    allowed = v == 2 and k >= 2
                else:
                    allowed = (v > 1 and m % k == 0 and k >= 2) if name == "interleaved" else v == 1
                config = search.Config(k, d, m, name, v, mode, offload)
                if not allowed or k * v > n or (offload != "none" and not config.recomputation()):
                    continue
                costs = model.costs(per_replica // m)
                weights = costs.balance_costs(mode)
                chunks = k * v
                fitting = []
                for cuts in itertools.combinations(range(1, n), chunks - 1):
                    balance = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
                    need = max(fp.total_bytes for fp in mm.footprints(
                        model.figures, balance, per_replica, m, name, mode, model.bytes_per_param, v, offload))
                    if need <= hw.memory or v > 1:
                        fitting.append((max(partition.stage_costs(weights, balance)), balance, need))
                if not fitting:
                    continue
                if v > 1:  # the min-max-time cut when it fits, else the fastest cut that fits
                    free = partition.balance_by_cost(weights, chunks)
                    fitting = [f for f in fitting if f[1] == free and f[2] <= hw.memory] or \
                        [f for f in fitting if f[2] <= hw.memory]
                    if not fitting:
                        continue
                top = min(f[0] for f in fitting)
                # Among cuts of equal largest stage cost, the search keeps the one balance_* picks.
                balance = min((f for f in fitting if math.isclose(f[0], top)), key=lambda f: f[1][::-1])[1]
                predicted = simulate.simulate_step(costs, balance, per_replica, m, name, mode,
                                                   hw.node_link if search.spans_nodes(hw, k) else hw.link, 1.0, v,
                                                   model.action_overhead)
                placed = "v" if name in SHAPED else "loop"
                stage_params = [sum(model.figures.layers[i].params
                                    for i in partition.stage_layers(balance, k, s, placed)) for s in range(k)]
                step = predicted.step_time + search.allreduce_seconds(stage_params, d, hw.link) + \
                    model.step_overhead * max(stage_params) / sum(stage_params)
                rate = model.batch / step
                if best is None or rate > best[0] + 1e-12:
                    best = (rate, config)
    return best


@pytest.mark.parametrize("seed,layers,devices,tightness", [
    (0, 5, 2, None), (1, 6, 4, None), (2, 6, 2, 0.5), (3, 5, 4, 0.3), (4, 8, 4, 0.1), (5, 7, 2, 0.7),
])
def test_search_finds_the_brute_force_optimum(seed, layers, devices, tightness):
    model = synthetic(layers, seed)
    memory = math.inf
    if tightness is not None:  # a budget that only some configurations' min-max-time cuts fit
        roomy = search.search(model, search.Hardware(devices, math.inf, FAST, FAST)).ranked
        peaks = sorted(o.peak for o in roomy if o.config.offload == "none" and o.config.schedule not in SHAPED)
        memory = peaks[int(tightness * (len(peaks) - 1))]
    hw = search.Hardware(devices, memory, FAST, FAST)
    result = search.search(model, hw)
    expected = brute_force(model, hw)
    assert expected is not None and result.best is not None
    assert result.best.samples_per_s == pytest.approx(expected[0], rel=1e-9)
    assert all(o.fits and o.peak <= memory for o in result.ranked)
    assert [o.samples_per_s for o in result.ranked] == sorted((o.samples_per_s for o in result.ranked), reverse=True)


def plain_configs(model, hw, schedules):
    """The configurations of `schedules` that keep every activation (no rematerialization)."""
    return [c for c in search.configs(model, hw) if c.schedule in schedules and c.checkpoint == "never"]


def test_equal_layers_and_free_links_predict_the_theoretical_bubble():
    model = synthetic(8, 0, batch=16, equal=True)
    hw = search.Hardware(4, math.inf, simulate.FREE, simulate.FREE)
    for config in plain_configs(model, hw, ("gpipe", "1f1b")):
        if config.partitions == 4:
            outcome = search.evaluate(model, hw, config)
            assert outcome.balance == [2, 2, 2, 2]
            assert outcome.bubble == pytest.approx(theoretical_bubble(4, config.microbatches), abs=1e-9)


def test_nothing_fits_names_the_least_memory_and_that_memory_fits():
    model = synthetic(6, 5)
    tight = search.search(model, search.Hardware(2, 1.0, FAST, FAST))
    assert tight.best is None and tight.smallest_memory is not None and tight.smallest is not None
    assert tight.smallest.peak == pytest.approx(tight.smallest_memory)
    enough = search.search(model, search.Hardware(2, tight.smallest_memory, FAST, FAST))
    assert enough.best is not None and enough.best.peak <= tight.smallest_memory
    below = search.search(model, search.Hardware(2, tight.smallest_memory * 0.999, FAST, FAST))
    # V=1 plans are exact; interleaved ones are only checked at their time-balanced cut, never below it.
    assert below.best is None or below.best.config.virtual > 1


def test_configurations_use_every_device_and_split_the_batch_evenly():
    model = synthetic(6, 0, batch=12)
    hw = search.Hardware(4, math.inf, FAST, FAST)
    seen = list(search.configs(model, hw))
    assert seen and all(c.partitions * c.replicas == 4 for c in seen)
    assert all((12 // c.replicas) % c.microbatches == 0 for c in seen)
    assert all(c.microbatches % c.partitions == 0 for c in seen if c.schedule == "interleaved")
    assert {c.schedule for c in seen} == set(SCHEDULES)
    assert all(c.virtual == 2 for c in seen if c.schedule in SHAPED)
    # Offload is tried where it rematerializes (its copies are priced at no time).
    assert {(c.checkpoint, c.offload) for c in seen} == {("always", "none"), ("always", "activations"),
                                                         ("except_last", "none"), ("except_last", "activations"),
                                                         ("never", "none")}
    assert all(c.recomputation() for c in seen if c.offload != "none")


def test_except_last_recomputes_nothing_where_each_forward_meets_its_backward_at_once():
    # The plan offered offload at K=1, M=1 except_last, and called such a run slower because it "recomputes more".
    def recomputation(k: int, m: int, schedule: str, v: int = 1, mode: str = "except_last") -> int:
        return search.Config(k, 1, m, schedule, v, mode).recomputation()
    assert recomputation(1, 1, "gpipe") == recomputation(2, 1, "gpipe") == recomputation(1, 4, "1f1b") == 0
    assert recomputation(1, 4, "gpipe") == recomputation(2, 4, "1f1b") == recomputation(2, 1, "v-half", 2) == 1
    assert recomputation(1, 1, "gpipe", mode="always") == 2 and recomputation(2, 4, "gpipe", mode="never") == 0


def test_where_only_offloading_or_a_v_fits_the_pick_is_one_of_them():
    model = synthetic(8, 1, batch=16)
    roomy = search.Hardware(2, math.inf, FAST, FAST)
    plain = min(search.min_max_memory(model, c)[0] for c in search.configs(model, roomy)
                if c.offload == "none" and c.schedule not in SHAPED)
    # Just below the least memory any plain configuration needs: only offload or the V placements fit.
    result = search.search(model, search.Hardware(2, plain * 0.999, FAST, FAST))
    assert result.best is not None and result.best.peak <= plain * 0.999
    assert all(o.config.offload != "none" or o.config.schedule in SHAPED for o in result.ranked)
    unlimited = search.search(model, roomy).best
    assert unlimited is not None and unlimited.config.offload == "none"  # it only ties where memory is no object


def test_a_pipeline_across_nodes_is_charged_the_node_link():
    model = synthetic(8, 1)
    slow = simulate.Link(1e3, 1e-2)
    one = search.Hardware(4, math.inf, FAST, slow, nodes=1)
    four = search.Hardware(4, math.inf, FAST, slow, nodes=4)
    config = search.Config(4, 1, 4, "gpipe", 1, "never")
    assert not search.spans_nodes(one, 4) and search.spans_nodes(four, 4)
    assert search.evaluate(model, four, config).step_time > search.evaluate(model, one, config).step_time


@pytest.mark.parametrize("seed", range(4))
def test_an_interleaved_plan_is_cut_to_fit_when_its_fastest_cut_does_not(seed):
    model = synthetic(8, seed)
    config = search.Config(2, 1, 4, "interleaved", 2, "never")
    roomy = search.evaluate(model, search.Hardware(2, math.inf, FAST, FAST), config)
    needs = search._memory(model, config).needs
    # What `gpipe plan` names as the least memory when nothing fits; any budget from there up finds a cut.
    leanest = max(needs(partition.least_memory(roomy.balance, needs)))
    assert leanest < roomy.peak  # the fastest cut is not the leanest
    budget = (leanest + roomy.peak) / 2
    tight = search.evaluate(model, search.Hardware(2, budget, FAST, FAST), config)
    assert tight.fits and tight.peak <= budget and tight.balance != roomy.balance
    assert tight.samples_per_s <= roomy.samples_per_s * (1 + 1e-9)  # here the fitting cut is the slower one


def test_ranks_that_run_faster_alone_speed_up_pipelines_by_their_idle_share_and_leave_replicas_alone():
    base = synthetic(8, 3, batch=16)
    faster = dataclasses.replace(base, alone_speedup=1.5)
    hw = search.Hardware(2, math.inf, FAST, FAST)
    gains = {}
    for config in plain_configs(base, hw, ("gpipe", "zero-bubble")):
        before, after = search.evaluate(base, hw, config), search.evaluate(faster, hw, config)
        if config.partitions == 1:  # two replicas compute at once all the time: nothing runs alone
            assert after.step_time == pytest.approx(before.step_time)
        else:
            assert after.step_time < before.step_time
            gains[(config.schedule, config.microbatches)] = before.step_time / after.step_time
    # The more a schedule idles, the more of its compute runs alone: GPipe gains more than zero-bubble.
    assert gains[("gpipe", 4)] > gains[("zero-bubble", 4)] > 1.0


def test_each_shape_is_priced_with_the_engine_ratio_measured_for_it():
    base = dataclasses.replace(synthetic(6, 5, batch=16), action_overhead=0.0)
    # Replicas measured 1.6x the layers' seconds, stages 1.2x (as on two CPU ranks): each shape its own.
    shaped = dataclasses.replace(base, factor=lambda size, k, d, v, schedule: 1.6 if k == 1 else 1.2)
    hw = search.Hardware(2, math.inf, FAST, FAST)
    replicas, stages = search.Config(1, 2, 2, "gpipe", 1, "never"), search.Config(2, 1, 4, "gpipe", 1, "never")
    for config, ratio in ((replicas, 1.6), (stages, 1.2)):
        profile, timed = shaped.profile(config), base.costs(4)
        assert profile.microbatch_size == 4
        assert profile.layers[2].forward == pytest.approx(ratio * timed.layers[2].forward)
        assert profile.loss == pytest.approx(ratio * timed.loss)
        before, after = search.evaluate(base, hw, config), search.evaluate(shaped, hw, config)
        # Compute scales by the shape's ratio; the per-step work (the optimizer) does not.
        assert after.step_time - after.fixed == pytest.approx(ratio * (before.step_time - before.fixed), rel=0.05)
        assert after.fixed == pytest.approx(before.fixed)


def test_a_plan_slower_for_its_messages_is_said_to_spend_more_time_in_them():
    # "more messages" named a K=3 M=1 plan that sends fewer messages than M=2, each twice the size.
    from gpipe_cli.plan import show

    model = synthetic(8, 1, batch=16)
    slow = simulate.Link(1e3, 1e-2)
    result = search.search(model, search.Hardware(2, math.inf, slow, slow))
    assert result.best is not None
    reasons = [show.reason(model, result.best, o, math.inf) for o in result.ranked[1:]]
    assert any(r.endswith("slower: more time in messages") for r in reasons), reasons


def test_the_search_is_estimated_by_the_actions_of_every_shape_it_prices():
    # Said before it starts, as the plan's phases are: a search of minutes was silent.
    model = synthetic(8, 1, batch=16)
    small, large = (search.Hardware(n, math.inf, FAST, FAST) for n in (2, 8))
    actions = [sum(k * v * m for k, _, m, _, v in search.shapes(model, hw)) for hw in (small, large)]
    assert 0 < actions[0] < actions[1]
    assert search.search_seconds(model, small, 1e-3) == pytest.approx(search.CALLS_PER_ACTION * 1e-3 * actions[0])
    # Every configuration searched is one of those shapes, with a remat mode and offload or not.
    assert {(c.partitions, c.replicas, c.microbatches, c.schedule, c.virtual) for c in search.configs(model, large)} \
        == set(search.shapes(model, large))


def test_of_predictions_within_half_a_percent_the_one_needing_least_memory_wins(monkeypatch):
    # A runner-up "as fast (within 0.5%)" needed 25.8 MiB against the winner's 57.6 MiB, and lost.
    def outcome(k, samples_per_s, peak, offload="none"):
        config = search.Config(k, 1, 4, "gpipe", 1, "except_last", offload)
        return search.Outcome(config, [1] * k, [peak] * k, True, step_time=8 / samples_per_s, batch=8)

    fastest, lean, leaner_offloaded, slower = (outcome(1, 1000.0, 60.0), outcome(2, 996.0, 26.0),
                                               outcome(3, 998.0, 10.0, "activations"), outcome(4, 900.0, 1.0))
    found = iter([fastest, lean, leaner_offloaded, slower])
    monkeypatch.setattr(search, "configs", lambda model, hw: range(4))
    monkeypatch.setattr(search, "evaluate", lambda model, hw, config: next(found))
    result = search.search(None, None)
    assert result.best is lean and result.ranked == [lean, fastest, leaner_offloaded, slower]


def test_a_runner_up_of_a_tie_says_why_it_loses():
    # One 0.9% below the fastest but 0.45% below the winner read "as fast (within 0.5%)", and lost for no reason given.
    from gpipe_cli.plan.show import reason

    def outcome(samples_per_s, peak, offload="none"):
        config = search.Config(2, 1, 4, "gpipe", 1, "except_last", offload)
        return search.Outcome(config, [1, 1], [peak, peak], True, step_time=8 / samples_per_s, batch=8)

    winner = outcome(995.5, 26.0)
    assert reason(None, winner, outcome(1000.0, 60.0), 100.0, 1000.0) == "as fast (within 0.5%), needs more memory"
    assert reason(None, winner, outcome(996.0, 10.0, "activations"), 100.0, 1000.0) == (
        "as fast (within 0.5%), offloads activations to host memory")
    assert reason(None, winner, outcome(991.0, 10.0), 100.0, 1000.0) == (
        "0.9% below the fastest: only those within 0.5% of it are as fast")


def test_a_runner_up_that_does_not_fit_names_its_fullest_stage():
    from gpipe_cli.plan.show import reason

    config = search.Config(2, 1, 4, "gpipe", 1, "except_last", "none")
    winner = search.Outcome(config, [1, 1], [2.0 * 2**30, 2.0 * 2**30], True, step_time=0.01, batch=8)
    over = search.Outcome(config, [1, 1], [3.0 * 2**30, 9.0 * 2**30], False, step_time=0.005, batch=8)
    assert reason(None, winner, over, 8.0 * 2**30).startswith("stage 1 needs 9.0 GiB > 8.0 GiB")


def test_a_ring_all_reduce_sends_each_stage_s_gradients_2_d_minus_1_times_a_dth_of_them():
    link = simulate.Link(1e6, 1e-3)  # bytes per second, seconds per hop
    # 4 replicas: 6 hops, each of a quarter of the largest stage's 3,000 fp32 gradients (12,000 bytes).
    assert search.allreduce_seconds([1000, 3000], 4, link) == pytest.approx(6 * 1e-3 + 6 / 4 * 12000 / 1e6)
    assert search.allreduce_seconds([1000, 3000], 1, link) == 0.0


def test_each_replica_is_charged_building_its_own_share_of_the_batch():
    model = dataclasses.replace(synthetic(4, 0, equal=True), data_seconds=2.0)
    hw = search.Hardware(4, math.inf, FAST, FAST)
    shares = {d: search.evaluate(model, hw, search.Config(4 // d, d, 2, "gpipe", 1, "never")).fixed for d in (1, 2, 4)}
    assert shares == {1: 2.0, 2: 1.0, 4: 0.5}
