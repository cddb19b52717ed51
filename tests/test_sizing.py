"""Sizing: the paper's model where it fits memory and time, else the same architecture smaller."""

import math

import pytest

from gpipe_cli import sizing
from gpipe_cli.bench.options import BenchOptions
from gpipe_cli.bench.preview import judge, need_bytes

GIB = 2**30


def machine(memory: float, rate: float, call: float = 1e-4, units: int = 2) -> sizing.Machine:
    return sizing.Machine("cpu", units, memory, rate, call)


def test_the_paper_model_is_chosen_where_it_fits():
    choice = sizing.choose("transformer", lambda c: sizing.Verdict(1.0, 2.0, 1.0, 2.0))
    assert not choice.scaled and choice.note == ""
    assert choice.params["layers"] == 48 and choice.params["d_model"] == 2048


def test_a_model_too_large_for_memory_is_scaled_down_and_announced():
    # A fake machine whose memory holds 50M parameters, with all the time in the world.
    choice = sizing.choose("transformer", lambda c: sizing.Verdict(c.parameters * 16, 50e6 * 16, 1.0, 2.0))
    chosen = sizing.candidate(choice.kind, choice.params)
    assert choice.scaled and chosen.parameters * 16 <= 50e6 * 16
    assert "needs" in choice.note and "is free" in choice.note and "--model/--layers" in choice.note
    assert "48-layer" in choice.note
    # The largest member that fits: the next larger one does not.
    members = [sizing.candidate(k, p) for k, p in sizing.ladder("transformer")]
    index = [m.params for m in members].index(choice.params)
    assert members[index - 1].parameters > 50e6


@pytest.mark.parametrize("family", ["transformer", "amoebanet"])
def test_the_largest_member_that_fits_is_found_judging_few_of_them(family):
    # Each member is smaller than the last in every size: the first that fits is found without judging each.
    members = [sizing.candidate(k, p) for k, p in sizing.ladder(family)]
    assert all(a.parameters > b.parameters and a.flops > b.flops for a, b in zip(members, members[1:]))
    for fitting in range(len(members) + 1):  # the index of the largest member that fits (past the end: none)
        limit = members[fitting].parameters if fitting < len(members) else 0
        judged: list[dict] = []

        def verdict(cand: sizing.Candidate, limit: float = limit, judged: list[dict] = judged) -> sizing.Verdict:
            judged.append(cand.params)
            return sizing.Verdict(cand.parameters, limit, 1.0, 2.0)

        choice = sizing.choose(family, verdict)
        assert choice.params == members[min(fitting, len(members) - 1)].params
        assert choice.scaled == (fitting > 0) and ("the smallest member" in choice.note) == (fitting == len(members))
        assert len(judged) <= 1 + math.ceil(math.log2(len(members))), (fitting, len(judged))


def test_the_paper_model_made_deeper_for_more_stages_is_not_called_the_papers():
    # For 100 stages the note said "the paper's 98-layer model"; the paper's has 48.
    choice = sizing.choose("transformer", lambda c: sizing.Verdict(c.parameters * 16, 50e6 * 16, 1.0, 2.0), stages=100)
    assert "the paper's 48-layer model, deepened to 98 layers for 100 stages, needs" in choice.note, choice.note


def test_a_model_too_slow_is_scaled_down_and_the_time_is_said():
    choice = sizing.choose("transformer", lambda c: sizing.Verdict(1.0, 2.0, c.flops, 1e9))
    assert choice.scaled and "would take" in choice.note
    assert sizing.candidate(choice.kind, choice.params).flops <= 1e9


@pytest.mark.parametrize("family", ["transformer", "amoebanet"])
def test_every_member_can_be_cut_into_eight_stages(family):
    from gpipe_cli.models.registry import build_model

    for kind, params in sizing.ladder(family):
        assert len(build_model(kind, **params).layers) >= 8, params


def test_a_slower_or_smaller_machine_gets_a_smaller_bench_model():
    options = BenchOptions(partitions=8, microbatches=32)
    big = sizing.choose("transformer", judge(options, machine(1000 * GIB, 1e15)))
    small = sizing.choose("transformer", judge(options, machine(16 * GIB, 1e10, call=5e-4)))
    size = {"big": sizing.candidate(big.kind, big.params).parameters,
            "small": sizing.candidate(small.kind, small.params).parameters}
    assert size["small"] < size["big"]
    assert small.verdict is not None and small.verdict.seconds <= sizing.TIME_BUDGET_S


def test_a_family_whose_layers_run_slower_is_estimated_slower_for_the_same_flops():
    # A Transformer's large products run near the measured rate, AmoebaNet's separable convolutions far below.
    transformer, amoebanet = (sizing.candidate(*sizing.ladder(f)[-1]) for f in ("transformer", "amoebanet"))
    cpu = machine(16 * GIB, 1e11, call=0.0)
    per_flop = {c.kind: sizing.step_seconds(c, cpu, 8, 1, 3.0) / c.flops for c in (transformer, amoebanet)}
    assert per_flop["amoebanet"] > 5 * per_flop["transformer"]
    assert sizing.layer_efficiency("cpu", "something-else") == 0.1  # unmeasured families: the cautious guess


def test_bench_estimates_grow_with_the_work():
    cand = sizing.candidate(*sizing.ladder("transformer")[4])
    slow, fast = machine(16 * GIB, 1e10), machine(16 * GIB, 1e11)
    options = BenchOptions(partitions=8, microbatches=32)
    assert judge(options, slow)(cand).seconds > judge(options, fast)(cand).seconds
    longer = BenchOptions(partitions=8, microbatches=32, steps=40)
    assert judge(longer, slow)(cand).seconds > judge(options, slow)(cand).seconds
    # On a CPU every rank holds a runtime: more ranks need more memory.
    assert need_bytes(cand, slow, options) > need_bytes(cand, slow, BenchOptions(partitions=2, microbatches=32))


def test_more_stages_than_a_member_has_layers_get_a_deeper_member():
    from gpipe_cli.models.registry import build_model

    choice = sizing.choose("transformer", lambda c: sizing.Verdict(c.parameters, 1e6, 1.0, 2.0), stages=16)
    assert choice.scaled and len(build_model(choice.kind, **choice.params).layers) >= 16


def _deepened_a_stack_at_a_time(kind, params, stages):
    """The former search, the reference: one stack of layers more until there are enough pipeline layers."""
    from gpipe_cli.models.registry import build_model

    step = 3 if kind == "amoebanet" else 1
    out = dict(params)
    while len(build_model(kind, **out).layers) < stages:
        out["layers"] = int(out["layers"]) + step
    return out


def _members():
    """Every ladder member, an encoder-decoder Transformer (two layers per `layers`) and an AmoebaNet with an
    auxiliary head (one layer more)."""
    from gpipe_cli.models.registry import resolve_preset

    return [*sizing.ladder("transformer"), *sizing.ladder("amoebanet"), resolve_preset("t-6-8192-16"),
            resolve_preset("amoebanet-d-18-256", aux_head=True, layers=3)]


@pytest.mark.parametrize("stages", [1, 8, 9, 10, 11, 16, 17, 33, 64, 128])
def test_deep_enough_gives_the_layers_the_stack_at_a_time_search_gave(stages):
    for kind, params in _members():
        assert sizing.deep_enough(kind, params, stages) == _deepened_a_stack_at_a_time(kind, params, stages), params


@pytest.mark.parametrize("stages", [2_000, 10_000])
def test_deep_enough_builds_a_few_specs_even_for_a_large_k(monkeypatch, stages):
    from gpipe_cli.models.registry import build_model

    built = []

    def counted(kind, **params):
        built.append(params.get("layers"))
        return build_model(kind, **params)

    monkeypatch.setattr(sizing, "build_model", counted)
    for kind, params in _members():
        built.clear()
        deeper = sizing.deep_enough(kind, params, stages)
        assert len(built) <= 3, (params, built)
        step = 3 if kind == "amoebanet" else 1
        # Just deep enough: one stack fewer would leave a stage without a layer.
        assert len(build_model(kind, **deeper).layers) >= stages
        assert len(build_model(kind, **{**deeper, "layers": deeper["layers"] - step}).layers) < stages


def test_ranks_sharing_a_gpu_start_together_on_the_host_cores(monkeypatch):
    # Starting a rank is the host's work: eight ranks on one GPU and 16 cores start as one wave, not eight.
    monkeypatch.setattr(sizing, "usable_cores", lambda: 16)
    gpu = sizing.Machine("cuda", 1, 1e11, 5e13, 1e-3)
    assert sizing.launch_seconds(8, gpu) == sizing.launch_seconds(1, gpu)
    monkeypatch.setattr(sizing, "usable_cores", lambda: 2)
    assert sizing.launch_seconds(8, gpu) > sizing.launch_seconds(2, gpu)
    # On a CPU the cores are the machine's units, as before.
    assert sizing.launch_seconds(8, sizing.Machine("cpu", 2, 1e10, 1e10, 1e-4)) == 6.0 + 4.0 * 4


def test_the_bench_memory_estimate_prices_the_balance_the_run_uses():
    # It priced a cut by FLOPs whatever --balance said: `--balance 1,3` and `3,1` printed the same two figures.
    from gpipe_cli.bench import bench_options
    from gpipe_cli.bench.preview import explicit_cut, memory
    from gpipe_cli.estimate.subject import resolve

    sizes = {"layers": 2, "d_model": 64, "ff": 128, "heads": 2, "vocab_size": 256, "seq_len": 16}
    here = machine(8 * GIB, 1e10)
    estimates = {}
    for balance in ("1,3", "3,1", None):
        options = bench_options(None, {"partitions": 2, "microbatches": 2, "balance": balance, **sizes}, [],
                                model="transformer")
        estimates[balance] = memory(resolve("transformer", sizes), options, here).stages[2]
        assert explicit_cut(options, 2) == (None if balance is None else [int(n) for n in balance.split(",")])
    assert estimates["1,3"][0] < estimates["1,3"][1] and estimates["3,1"][0] > estimates["3,1"][1]


def test_a_step_is_its_forwards_at_the_rate_and_a_fixed_cost_per_layer_call_of_each_micro_batch():
    # A recompute is one more forward: `except_last` and `always` run four passes' worth, `never` three.
    assert [sizing.passes(c) for c in ("never", "except_last", "always")] == [3.0, 4.0, 4.0]
    cand = sizing.Candidate("transformer", {}, 0, flops=1e9, pipeline_layers=6)
    cpu = machine(16 * GIB, 1e11, call=1e-3)
    rate, per_call = sizing.layer_rate(cpu, "transformer")
    one, eight = (sizing.step_seconds(cand, cpu, 16, m, 4.0) for m in (1, 8))
    assert one == pytest.approx(16 * 1e9 * 4.0 / rate + 6 * 4.0 * per_call)
    assert eight - one == pytest.approx(7 * 6 * 4.0 * per_call)


def test_a_member_deeper_than_the_probe_depths_is_priced_as_the_model_built():
    from gpipe_cli.estimate import kept
    from gpipe_cli.models import families
    from gpipe_cli.models.registry import build_model

    # A member deeper than the two probe depths was priced one probe step short (a layer's parameters and FLOPs).
    params = dict(layers=5, d_model=32, ff=64, heads=2, vocab_size=100, max_len=8)
    assert params["layers"] > max(families.of("transformer").probe_depths)
    cand = sizing.candidate("transformer", params)
    built = kept.summary(build_model("transformer", **params), 2)
    assert (cand.parameters, cand.flops) == (built.total_params, built.total_flops)


def test_forked_ranks_start_in_waves_of_the_cores():
    # Forked ranks were priced one start each, not one per wave: four ranks on two cores cost four starts.
    cpu = machine(8 * GIB, 1e10, units=2)
    assert sizing.launch_seconds(4, cpu, forking=True) == pytest.approx(
        sizing.FORKED_FIRST_S + 2 * sizing.FORKED_RANK_S)
    assert sizing.launch_seconds(4, cpu, first=False, forking=True) == pytest.approx(2 * sizing.FORKED_RANK_S)


def test_a_model_that_does_not_fit_is_said_against_the_memory_free_not_the_share_measured():
    # The free memory was said as a quarter of itself: the share a measurement may use, halved again.
    have = 4 * GIB * sizing.MEMORY_SHARE  # a measurement may use half of 4 GiB free
    assert sizing.Verdict(3 * GIB, have, 1.0, 2.0).why_not("the model") == (
        "the model needs 3.0 GiB, more than half of the 4.0 GiB free")
    assert sizing.Verdict(5 * GIB, have, 1.0, 2.0).why_not("the model") == "the model needs 5.0 GiB, 4.0 GiB is free"
