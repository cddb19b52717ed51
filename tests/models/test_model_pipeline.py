"""Both model families trained through the real pipeline (gloo ranks on CPU)."""

from collections.abc import Callable

import pytest
import torch

from tests.models import pipeline_ranks as pr
from tests.multiproc import results, run_ranks
from tests.pipeline.together import several, shared_jobs

pytestmark = pytest.mark.slow


def merged(outcome: list[dict]) -> dict:
    state: dict = {}
    for part in outcome:
        state.update(part["state"])
    return state


def errors(state: dict, reference: dict) -> dict[str, float]:
    """Each floating-point tensor's relative difference from the reference (the same names on both sides)."""
    assert set(state) == set(reference)
    # The floor: an attention key bias has an exactly zero gradient (softmax ignores a shift shared by
    # all keys), so it holds only ~1e-10 of rounding noise whose ratio means nothing.
    return {key: float((state[key] - value).norm() / value.norm().clamp_min(1e-3))
            for key, value in reference.items() if value.is_floating_point()}


# Beyond GPipe at K=2 and 4: a split backward through attention, interleaved chunks with a tied softmax.
# AmoebaNet's other schedules are compared in float64 below: its BatchNorm over micro-batches of three
# images grows rounding about 1e5-fold in three steps, and 1F1B-like schedules (backwards in another
# order) round float32 sums differently, which ends percents apart.
SCHEDULES = {"amoebanet": [], "transformer": [(2, "zero-bubble", 1)], "lm": [(2, "interleaved", 2)]}


FAMILIES = ["amoebanet", "transformer", "lm"]
DOUBLE = [("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2)]

# Every multi-rank run of this module by number of ranks (with pr.train's arguments): the runs of one
# size share one job's rank processes.
JOBS: dict[int, dict] = {
    2: {**{("same", family, schedule, virtual): (pr.train, (family, 2, 3, 4, False, schedule, virtual))
           for family in FAMILIES for stages, schedule, virtual in [(2, "gpipe", 1), *SCHEDULES[family]]
           if stages == 2},
        **{("double", schedule, virtual): (pr.train, ("amoebanet", 2, 3, 4, False, schedule, virtual, True))
           for schedule, virtual in DOUBLE},
        **{("learned", family): (pr.train, (family, 2, 40, 4, True)) for family in FAMILIES}},
    4: {("same", family, "gpipe", 1): (pr.train, (family, 4, 3, 4, False, "gpipe", 1)) for family in FAMILIES},
}


@pytest.fixture(scope="module")
def ran() -> Callable[[int, tuple], list[dict]]:
    """(ranks, key) -> each rank's outcome of that run of JOBS (each size's runs made once, in one job)."""
    return shared_jobs(lambda world, calls: results(run_ranks(several, world, calls, timeout=540)), JOBS)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_parameters_for_any_number_of_stages(family, ran):
    """K=1 vs K=2 vs K=4 after 3 steps, fp32, dropout on, BatchNorm deferred: relative difference <= 1e-5."""
    reference = pr.train(family, 1, steps=3)["state"]
    for stages, schedule, virtual in [(2, "gpipe", 1), (4, "gpipe", 1), *SCHEDULES[family]]:
        state = merged(ran(stages, ("same", family, schedule, virtual)))
        for key, error in errors(state, reference).items():
            assert error <= 1e-5, (stages, schedule, key, error)


def test_every_schedule_trains_amoebanet_as_one_process_does_in_float64(ran):
    """1F1B, zero-bubble and interleaved against K=1 after 3 steps, with BatchNorm and dropout: <= 1e-9."""
    reference = pr.train("amoebanet", 1, steps=3, double=True)["state"]
    assert torch.get_default_dtype() == torch.float32  # restored for the tests that follow in this process
    for schedule, virtual in DOUBLE:
        state = merged(ran(2, ("double", schedule, virtual)))
        assert all(v.dtype == torch.float64 for v in reference.values() if v.is_floating_point())
        for key, error in errors(state, reference).items():
            assert error <= 1e-9, (schedule, key, error)


@pytest.fixture(scope="module")
def learned(ran) -> Callable[[str], list[dict]]:
    """A family trained for 40 steps on its generated task through two stages (each family run once)."""
    return lambda family: ran(2, ("learned", family))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_generated_task_is_learned_through_two_stages(family, learned):
    outcome = learned(family)
    losses = outcome[-1]["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"{family}: loss {first:.3f} -> {last:.3f}"


def test_tied_embedding_and_softmax_on_different_stages_stay_equal(learned):
    """Bit for bit after 40 Adam steps; that the pair also equals one-process training is checked with every
    other parameter in test_the_same_parameters_for_any_number_of_stages."""
    outcome = learned("transformer")
    spec = pr.spec_of("transformer")
    (embedding, softmax), = spec.tied
    state = merged(outcome)
    stage_of = {part["stage"]: set(part["state"]) for part in outcome}
    assert embedding in stage_of[0] and softmax in stage_of[1]  # really on different stages
    assert torch.equal(state[embedding], state[softmax])
