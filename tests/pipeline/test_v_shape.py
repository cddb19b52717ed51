"""V-shaped placement: the first and last chunks on stage 0, the turn's two chunks on stage K-1 in memory;
zero-bubble-v and v-half train to plain training's parameters."""

from __future__ import annotations

import itertools

import pytest
import torch

from gpipe_cli import memory_model as mm
from gpipe_cli.pipeline import placement, topology
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.actions import SHORT
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers
from gpipe_cli.pipeline.schedule import Kind
from gpipe_cli.pipeline.schedules import v_shape
from tests.multiproc import results, run_ranks
from tests.pipeline import loopback, ranks, toy
from tests.pipeline.test_engine import TOLERANCE

SHAPED = ("zero-bubble-v", "v-half")
MODES = sched.REMAT_MODES


def test_v_placement_goes_down_the_stages_and_back_up():
    assert [placement.owner(c, 3, "v") for c in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [placement.owner(c, 3) for c in range(6)] == [0, 1, 2, 0, 1, 2]
    assert placement.chunks_of(0, 3, 2, "v") == [0, 5] and placement.last_stage(3, 2, "v") == 0
    assert stage_layers([1, 2, 1, 1, 2, 1], 3, 2, "v") == [3, 4]


@pytest.mark.parametrize("name", SHAPED)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_the_turn_hands_over_in_memory_and_every_message_meets_its_receive(name, stages):
    for microbatches in (stages, 2 * stages, 2 * stages + 1):
        lists = sched.build_all(name, stages, microbatches, "except_last", 2)
        turn = lists[stages - 1]
        assert not any(a.chunk == stages and a.kind in (Kind.RECV_FWD, Kind.SEND_BWD) for a in turn)
        assert not any(a.chunk == stages - 1 and a.kind in (Kind.SEND_FWD, Kind.RECV_BWD) for a in turn)
        for s, plan in enumerate(lists):
            assert {a.chunk for a in plan} == set(placement.chunks_of(s, stages, 2, "v"))
        sched.simulate(lists, lambda s, a: 1.0, placement="v")  # raises on a deadlock


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_zero_bubble_v_idles_no_more_than_zero_bubble_and_v_half_holds_fewer_activations(stages):
    for microbatches in (stages, 2 * stages, 2 * stages + 1):
        assert sched.theoretical_bubble(stages, microbatches, "zero-bubble-v", 2) <= \
            sched.theoretical_bubble(stages, microbatches, "zero-bubble") + 1e-9
        for name, cap in (("zero-bubble-v", 2 * stages), ("v-half", stages)):
            for plan in sched.build_all(name, stages, microbatches, "never", 2):
                held = peak = 0
                for a in plan:
                    held += (a.kind == Kind.FWD) - (a.kind in sched.RELEASE)
                    peak = max(peak, held)
                assert peak <= cap, (name, microbatches)


@pytest.mark.parametrize("microbatches", [2, 4, 8, 16])
def test_zero_bubble_v_on_two_stages_idles_no_more_than_zero_bubble_when_messages_take_time(microbatches):
    """Each message a tenth or a quarter of a stage's forward late: the V's round trips through stage 0 and
    the turn keep slack for it, as zero-bubble's order does (without, the V idled 0.080 against 0.055 at M=8)."""
    units = {Kind.FWD: 1.0, Kind.BWD_INPUT: 1.0, Kind.BWD_WEIGHT: 1.0, Kind.BWD: 2.0}

    def idle(name: str, virtual: int, latency: float) -> float:
        lists = sched.build_all(name, 2, microbatches, "never", virtual)
        spans = sched.simulate(lists, lambda stage, a: units.get(a.kind, 0.0) / virtual, lambda stage, a: latency,
                               placement="v" if virtual == 2 else "loop")
        return sched.bubble(spans)

    for latency in (0.1, 0.25):
        assert idle("zero-bubble-v", 2, latency) <= idle("zero-bubble", 1, latency) + 1e-9, latency


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_a_greedy_run_replayed_lasts_as_the_simulator_runs_its_orders(stages, monkeypatch, request):
    """A run lists each step after what it needs, so its replay (a tick half a forward, a message one tick late or
    free) ends when the simulated step of its orders does."""
    request.addfinalizer(sched._built.cache_clear)
    units = {Kind.FWD: 1.0, Kind.BWD_INPUT: 1.0, Kind.BWD_WEIGHT: 1.0, Kind.BWD: 2.0}
    microbatches, cost = 2 * stages + 1, lambda stage, action: units.get(action.kind, 0.0)
    for forwards_first, between, delay in itertools.product((False, True), (None, 1, 2), (0, 1)):
        run = v_shape._greedy(stages, microbatches, 2 * stages, forwards_first, between, delay)
        ordered = tuple(tuple(step for s, step in run if s == stage) for stage in range(stages))
        monkeypatch.setattr(v_shape, "orders", lambda *_, chosen=ordered: chosen)
        sched._built.cache_clear()  # built lists are kept: these orders are not the schedule's
        lists = sched.build_all("zero-bubble-v", stages, microbatches, "never", 2)
        for late in (0, 1):
            spans = sched.simulate(lists, cost, lambda stage, action, t=late: t / 2, placement="v")
            step = max(span.end for stage in spans for span in stage)
            assert 2 * step == v_shape._replay(run, stages, microbatches, late), (forwards_first, between, delay)


def test_zero_bubble_v_on_two_stages_keeps_its_order():
    """The greedy run chosen for K=2, M=3: each stage's F, Bi, W and B (the first chunk's whole backward)."""
    shown = [" ".join(f"{SHORT[kind]}{mb}/c{chunk}" for kind, mb, chunk in order)
             for order in v_shape.orders(2, 3, 4)]
    assert shown == ["F0/c0 F1/c0 F2/c0 F0/c3 Bi0/c3 W0/c3 F1/c3 Bi1/c3 B0/c0 B1/c0 W1/c3 F2/c3 Bi2/c3 W2/c3 B2/c0",
                     "F0/c1 F0/c2 F1/c1 F1/c2 Bi0/c2 Bi0/c1 W0/c2 Bi1/c2 Bi1/c1 F2/c1 W0/c1 F2/c2 W1/c2 W1/c1 Bi2/c2 "
                     "Bi2/c1 W2/c2 W2/c1"]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_v_half_holds_at_most_six_tenths_of_1f1bs_activations_on_every_stage(stages):
    """Equal layers, each saving 1 MiB per micro-batch: bytes, as the memory model walks the action lists."""
    layer = mm.LayerFigures("layer", 1, mm.Affine(2**20, 0.0), mm.ZERO)
    figures = mm.ModelFigures(mm.ZERO, (layer,) * 4 * stages)

    def peaks(name: str, balance: list[int], microbatches: int, virtual: int) -> list[float]:
        return [f.peak_bytes for f in mm.footprints(figures, balance, microbatches, microbatches, name, "never",
                                                    0.0, virtual)]

    for microbatches in (stages, 2 * stages):
        fullest = max(peaks("1f1b", [4] * stages, microbatches, 1))
        assert fullest == 2 * stages * 2 * 2**20  # K micro-batches of 4 layers on stage 0
        assert max(peaks("v-half", [2] * 2 * stages, microbatches, 2)) <= 0.6 * fullest, microbatches


def test_a_v_schedule_refuses_other_than_two_chunks_per_stage_in_one_line():
    with pytest.raises(ValueError, match="schedule 'v-half' runs 2 chunks per stage: virtual_stages must be 2"):
        PipelineConfig(2, 4, schedule="v-half")


def _train(rank: int, world: loopback.World, stages: int, name: str, microbatches: int, mode: str) -> dict:
    topo = loopback.topology(world, rank, stages)
    cut = [len(part) for part in torch.arange(8).tensor_split(2 * stages)]
    config = PipelineConfig(stages, microbatches, virtual=2, schedule=name, checkpoint=mode, balance=tuple(cut))
    layers = world.build(lambda: build_layers(toy.MODELS["deep"]["factories"](), stage_layers(cut, stages, rank, "v"),
                                              toy.SEED))
    pipe = Pipeline(layers, topo, config, toy.MODELS["deep"]["loss"], tied=toy.MODELS["deep"]["tied"])
    assert pipe.layout.is_first == pipe.layout.is_last == (rank == 0)
    step = pipe.train_step(*toy.batch("deep", 9, 11), step=9)  # gathered on rank 0: from itself, the last chunk's
    if rank == 0:
        assert step.stats is not None and step.stats.loss == step.loss > 0 and step.stats.examples == 11
    pipe.zero_grad()
    ranks.train(pipe, "deep", microbatches)
    return {k: v.clone() for k, v in pipe.state_dict().items()}


# K in {2, 3, 4} x M in {K, 2K, 2K + 1}, each schedule with each remat mode at least once
CASES = [(SHAPED[i % 2], k, m, MODES[i % 3])
         for i, (k, m) in enumerate((k, m) for k in (2, 3, 4) for m in (k, 2 * k, 2 * k + 1))]


@pytest.mark.parametrize(("name", "stages", "microbatches", "mode"), CASES)
def test_v_schedules_train_to_plain_trainings_parameters(name, stages, microbatches, mode):
    """Tied embedding and softmax (both on stage 0), dropout, uneven micro-batches and a smaller last batch."""
    world = loopback.World(stages, "cpu")
    state = {k: v for part in world.run(_train, world, stages, name, microbatches, mode) for k, v in part.items()}
    errors = toy.relative_errors(state, toy.reference("deep", microbatches))
    assert max(errors.values()) < TOLERANCE, (mode, errors)


@pytest.mark.slow
def test_v_schedules_on_two_gloo_ranks_train_to_plain_trainings_parameters():
    configs = [(4, "zero-bubble-v", "except_last"), (3, "v-half", "always")]
    states = results(run_ranks(ranks.grid, 2, "deep", 2, [2, 2, 2, 2], configs))
    for config in configs:
        state = {k: v for part in states for k, v in part[config].items()}
        assert torch.equal(state["0.embed.weight"], state["7.proj.weight"]), config
        errors = toy.relative_errors(state, toy.reference("deep", config[0]))
        assert max(errors.values()) < TOLERANCE, (config, errors)


def _evaluate(rank: int, world: loopback.World, stages: int, name: str, size: int) -> tuple:
    topo = loopback.topology(world, rank, stages)
    cut = [len(part) for part in torch.arange(8).tensor_split(2 * stages)]
    config = PipelineConfig(stages, 4, virtual=2, schedule=name, balance=tuple(cut))
    spec = toy.MODELS["deep"]
    layers = world.build(lambda: build_layers(spec["factories"](), stage_layers(cut, stages, rank, "v"), toy.SEED))
    pipe = Pipeline(layers, topo, config, spec["loss"], tied=spec["tied"])
    x, y = toy.batch("deep", 7, size)
    result = pipe.evaluate(x if pipe.layout.is_first else None, y if pipe.layout.is_last else None,
                           return_outputs=True)
    return result.loss, result.units, result.outputs


@pytest.mark.parametrize("name", SHAPED)
def test_v_schedules_evaluate_as_one_process_does(name):
    """Each chunk's forward on its own stage of the V (stage 0 the first and the last), batches above and below M."""
    spec = toy.MODELS["deep"]
    single = Pipeline(build_layers(spec["factories"](), range(8), toy.SEED), topology.local(),
                      PipelineConfig(balance=(8,)), spec["loss"], tied=spec["tied"])
    for stages, size in ((2, 6), (3, 2)):
        ref = single.evaluate(*toy.batch("deep", 7, size), microbatches=4, return_outputs=True)
        world = loopback.World(stages, "cpu")
        outcome = world.run(_evaluate, world, stages, name, size)
        assert all(loss == pytest.approx(ref.loss, rel=1e-5) and units == ref.units for loss, units, _ in outcome)
        assert torch.allclose(outcome[0][2], ref.outputs, rtol=1e-5, atol=1e-6), (stages, size)
