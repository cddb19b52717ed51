"""`balance: auto` cuts by cost among the cuts that fit memory, and refuses with the numbers when none does."""

import dataclasses
import itertools
import math
import random

import pytest

from gpipe_cli import memory_model as mm
from gpipe_cli.pipeline import partition
from gpipe_cli.train import cut
from gpipe_cli.units import human_bytes


def figures(layers: int, seed: int) -> mm.ModelFigures:
    """A made-up model whose layers differ in parameters and activations."""
    rng = random.Random(seed)
    rows = tuple(mm.LayerFigures(f"l{i}", rng.randint(1, 50) * 10_000, mm.Affine(0, rng.randint(1, 40) * 10_000),
                                 mm.Affine(0, rng.randint(1, 10) * 1_000), mm.Affine(0, 1_000))
                 for i in range(layers))
    return mm.ModelFigures(mm.Affine(0, 1_000), rows)


def memory(figs: mm.ModelFigures, stages: int, capacity: float, schedule: str = "gpipe") -> mm.CutMemory:
    return mm.CutMemory(figs, stages, 8, 4, schedule, "never", 16.0, capacity, "test machine")


def cuts(layers: int, stages: int):
    for inner in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *inner, layers)
        yield [bounds[s + 1] - bounds[s] for s in range(stages)]


def needs(m: mm.CutMemory, balance: list[int]) -> list[float]:
    return [m.need(s, r.start, r.stop) for s, r in enumerate(partition.stage_ranges(balance))]


@pytest.mark.parametrize("seed", range(6))
def test_when_the_fastest_cut_does_not_fit_the_fastest_that_fits_is_chosen(seed):
    rng = random.Random(seed)
    figs, stages = figures(7, seed), 3
    costs = [rng.uniform(0.1, 3.0) for _ in range(7)]
    free = partition.balance_by_cost(costs, stages)
    roomy = memory(figs, stages, float("inf"))
    # Just less than the fastest cut needs, but no less than what the leanest cut needs.
    leanest = min(max(needs(roomy, b)) for b in cuts(7, stages))
    capacity = max(leanest, max(needs(roomy, free)) * 0.999)
    m = memory(figs, stages, capacity)
    fitting = [b for b in cuts(7, stages) if max(needs(m, b)) <= capacity]
    chosen, moved = cut.within_memory(costs, m)
    assert max(needs(m, chosen)) <= capacity
    best = min(max(partition.stage_costs(costs, b)) for b in fitting)
    assert max(partition.stage_costs(costs, chosen)) == pytest.approx(best)
    assert moved == (max(needs(m, free)) > capacity)
    if moved:
        assert max(partition.stage_costs(costs, chosen)) >= max(partition.stage_costs(costs, free))


def test_a_cut_that_fits_is_kept_as_it_is():
    figs = figures(6, 1)
    costs = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    assert cut.within_memory(costs, memory(figs, 2, float("inf"))) == (partition.balance_by_cost(costs, 2), False)


@pytest.mark.parametrize("seed", range(4))
def test_no_cut_fits_refuses_with_the_smallest_peak_and_what_a_rank_has(seed):
    figs, stages = figures(6, seed), 3
    roomy = memory(figs, stages, float("inf"))
    leanest = min(max(needs(roomy, b)) for b in cuts(6, stages))
    m = memory(figs, stages, leanest * 0.9)
    with pytest.raises(cut.NoCutFits) as caught:
        cut.within_memory([1.0] * 6, m)
    line = str(caught.value)
    peak, balance = m.least([1.0] * 6)
    assert peak == pytest.approx(leanest) and max(needs(m, balance)) == pytest.approx(leanest)
    stage = needs(m, balance).index(max(needs(m, balance)))
    assert f"(balance {balance}: stage {stage} needs {human_bytes(peak)})" in line
    assert "\n" not in line and "no cut of the 6 pipeline layers into 3 stages fits" in line
    assert f"smallest per-stage peak any cut reaches is {human_bytes(leanest)}" in line
    assert f"each rank has {human_bytes(leanest * 0.9)} (test machine)" in line
    each = [figs.params([range(i, i + 1)]) * 16.0 for i in range(6)]
    if max(partition.stage_costs(each, partition.balance_by_cost(each, stages))) <= leanest * 0.9:
        assert "pipeline.checkpoint: always" in line and "data.batch_size" in line
    else:  # seed 2: no cut's weights alone fit, which no batch or remat changes (it was told to change them)
        assert "pipeline.checkpoint" not in line and "choose a smaller model" not in line
        assert "Weights, gradients and optimizer state alone need" in line and "raise pipeline.partitions" in line


@pytest.mark.parametrize("shared", [False, True])
def test_a_stage_whose_weights_alone_are_over_is_told_what_can_help(shared):
    # It was told to lower the batch or rematerialize, which change only activations.
    figs = figures(6, 0)
    each = [figs.params([range(i, i + 1)]) * 16.0 for i in range(6)]
    lightest = max(partition.stage_costs(each, partition.balance_by_cost(each, 2)))  # any cut's stage has this
    m = dataclasses.replace(memory(figs, 2, lightest * 0.9), shared=shared)
    with pytest.raises(cut.NoCutFits) as caught:
        cut.within_memory([1.0] * 6, m)
    line = str(caught.value)
    total = figs.params([range(6)]) * 16.0
    assert f"Weights, gradients and optimizer state alone need {human_bytes(lightest)} on some stage of any cut" \
        in line and "data.batch_size" not in line, line
    assert f"all stages' {human_bytes(total)}" in line
    if shared:
        assert line.endswith("choose a smaller model or a larger machine"), line
    else:
        assert "raise pipeline.partitions" in line and line.endswith(f"{math.ceil(total / m.capacity)} ranks' worth)")
    # A layer heavier than a device: more ranks would not split it.
    heavy = dataclasses.replace(memory(figs, 2, max(each) * 0.9), shared=shared)
    with pytest.raises(cut.NoCutFits) as caught:
        cut.within_memory([1.0] * 6, heavy)
    assert str(caught.value).endswith("choose a smaller model or a larger machine"), caught.value


@pytest.mark.parametrize("seed", range(6))
def test_interleaved_stages_are_cut_to_fit_when_the_fastest_cut_does_not(seed):
    rng = random.Random(seed)
    figs, stages, virtual = figures(8, seed), 2, 2
    costs = [rng.uniform(0.1, 3.0) for _ in range(8)]
    roomy = memory(figs, stages, float("inf"), "interleaved")
    free = partition.balance_by_cost(costs, stages * virtual)
    leanest = min(max(roomy.needs(b)) for b in cuts(8, stages * virtual))
    assert leanest < max(roomy.needs(free))  # these made-up models leave room to move
    capacity = (leanest + max(roomy.needs(free))) / 2
    m = memory(figs, stages, capacity, "interleaved")
    chosen, moved = cut.within_memory(costs, m, virtual)
    assert moved and len(chosen) == stages * virtual and max(m.needs(chosen)) <= capacity
    assert max(partition.stage_costs(costs, chosen)) >= max(partition.stage_costs(costs, free))


def test_no_interleaved_cut_fits_says_so_in_one_line():
    figs = figures(8, 0)
    m = memory(figs, 2, 1.0, "interleaved")
    with pytest.raises(cut.NoCutFits) as caught:
        cut.within_memory([1.0] * 8, m, 2)
    line = str(caught.value)
    peak, balance = m.least([1.0] * 8, 2)
    assert "\n" not in line and "into 2 x 2 chunks (interleaved) fits" in line and len(balance) == 4
    assert f"the smallest per-stage peak the search found is {human_bytes(peak)}" in line
