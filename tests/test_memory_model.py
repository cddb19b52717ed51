"""The memory model: per-layer figures from shapes equal measured ones; capacity per rank; the walk's trends."""

import pytest
import torch

from gpipe_cli import memory_model as mm
from gpipe_cli.models.registry import build_model

TRANSFORMER = dict(arch="decoder-only", layers=3, d_model=32, ff=64, heads=2, vocab_size=64, max_len=8)
AMOEBA = dict(variant="d", layers=3, filters=8, image_size=32, num_classes=4)


@pytest.mark.parametrize("kind,params", [("transformer", TRANSFORMER), ("amoebanet", AMOEBA)])
def test_figures_from_shapes_match_figures_measured_on_the_cpu(kind, params):
    spec = build_model(kind, **params)
    meta, cpu = mm.measure(spec, device="meta"), mm.measure(spec)
    assert meta.input == cpu.input
    for a, b in zip(meta.layers, cpu.layers, strict=True):
        assert a.params == b.params
        assert a.output.at(4) == pytest.approx(b.output.at(4))
        # Within a few percent: dropout masks are saved as bytes on the CPU and as floats on the meta device.
        assert a.saved.at(4) == pytest.approx(b.saved.at(4), rel=0.03, abs=64), a.name


def test_more_microbatches_and_more_stages_lower_the_fullest_stage():
    figures = mm.measure(build_model("transformer", **{**TRANSFORMER, "layers": 6}), device="meta")
    n = len(figures.layers)

    def fullest(balance, m, checkpoint="except_last"):
        return max(fp.total_bytes for fp in mm.footprints(figures, balance, 32, m, "gpipe", checkpoint, 16.0))

    assert fullest([n], 1, "never") > fullest([n], 8) > fullest([4, 4], 8)


def test_weights_cost_what_the_optimizer_keeps():
    assert mm.bytes_per_parameter("plain-sgd") == 8
    assert mm.bytes_per_parameter("sgd") == 12
    assert mm.bytes_per_parameter("adam") == 16


def test_cpu_ranks_share_the_ram_and_gpus_have_their_own():
    cpu = mm.capacity(4, "cpu", available=8e9)
    assert cpu.shared and cpu.per_rank_bytes == 2e9 and "shared by 4 ranks" in cpu.description
    gpu = mm.capacity(4, "cuda", available=8e9)
    assert not gpu.shared and gpu.per_rank_bytes == 8e9


def test_available_memory_is_positive():
    assert mm.available_bytes("cpu") > 0


def test_shapes_price_a_layer_larger_than_this_machines_memory():
    # Built on the CPU first, a 4 TiB embedding failed to allocate (a traceback) before anything was priced.
    spec = build_model("transformer", arch="decoder-only", layers=1, d_model=2**16, ff=8, heads=1,
                       vocab_size=2**24, max_len=2)
    figures = mm.measure(spec, device="meta")
    assert figures.layers[0].params >= 2**40  # the token embedding alone


def test_a_v_fit_search_reaches_a_far_cut_of_a_deep_model():
    # 300 alike layers in a V of 16 chunks: the leanest cut is far from the even one (the first chunk holds 59
    # layers), more single-layer moves away than a shallow model's search may price; a budget just above it fits.
    from gpipe_cli.memory_model import Affine, LayerFigures, ModelFigures, stage_needs, v_fit
    from gpipe_cli.pipeline import partition

    layers = tuple(LayerFigures(f"layer_{i}", 10_000, Affine(0, 4e6), Affine(0, 2e5), Affine(0, 2e5))
                   for i in range(300))
    figures = ModelFigures(Affine(0, 1e3), layers)
    args = (32, 8, "v-half", "except_last", 16.0)
    known: dict = {}

    def needs(balance):
        return stage_needs(figures, balance, *args, 2, known)

    even = partition.balance_by_cost([layer.saved.at(4) + layer.params * 16 for layer in layers], 16)
    leanest = max(needs(partition.least_memory(even, needs)))
    assert leanest < 0.6 * max(needs(even))
    found = v_fit(figures, 8, 1.02 * leanest, *args)
    assert found is not None and max(fp.total_bytes for fp in found) <= 1.02 * leanest


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rmsprop"])
def test_a_primed_optimizer_holds_its_state_before_the_first_step_and_moves_no_weight(optimizer):
    # A device probe measures one step: its optimizer must hold its state through it, as from a second step on.
    layer = torch.nn.Linear(8, 4)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = mm.primed(optimizer, list(layer.parameters()))
    assert len(opt.state) == 2 and all(p.grad is None for p in layer.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))


def test_a_search_prices_each_stage_as_its_whole_footprint_totals():
    """`stage_needs` (the search's peak-only pricing) equals every stage's footprint total, bit for bit."""
    from gpipe_cli.pipeline import schedules
    from gpipe_cli.pipeline.config import OFFLOAD_MODES, REMAT_MODES

    figures = mm.measure(build_model("transformer", **{**TRANSFORMER, "layers": 6}), device="meta")
    for schedule in schedules.names():
        virtual = 2 if schedules.get(schedule).chunked else 1
        balance = [2, 1, 2, 1, 1, 1][:2 * virtual] if virtual == 2 else [3, 2, 1]
        balance[-1] += len(figures.layers) - sum(balance)
        for checkpoint in REMAT_MODES:
            for offload in OFFLOAD_MODES:
                args = (figures, balance, 31, 6, schedule, checkpoint, 16.0)
                totals = [fp.total_bytes for fp in mm.footprints(*args, virtual, offload)]
                assert mm.stage_needs(*args, virtual, {}, offload) == totals, (schedule, checkpoint, offload)


@pytest.mark.parametrize("kind,params", [("transformer", {**TRANSFORMER, "layers": 4}),
                                         ("transformer", dict(layers=2, d_model=16, ff=32, heads=2, vocab_size=32,
                                                              max_len=8)),
                                         ("amoebanet", AMOEBA)])
def test_the_cut_searchs_memory_floor_is_below_every_stage_and_grows_with_it(kind, params):
    """`memory_floor` is below every stage in any place, grows as a stage starts earlier, and changes no cut."""
    from gpipe_cli.pipeline import partition, schedules
    from gpipe_cli.pipeline.config import OFFLOAD_MODES, REMAT_MODES

    figures = mm.measure(build_model(kind, **params), device="meta")
    n, stages = len(figures.layers), 3
    tight = 0
    for schedule in (name for name in schedules.names() if not schedules.get(name).chunked):
        for checkpoint in REMAT_MODES:
            for offload in OFFLOAD_MODES:
                memory = mm.CutMemory(figures, stages, 12, 3, schedule, checkpoint, 16.0, offload=offload)
                for stop in range(1, n + 1):
                    floors = [memory.floor(start, stop) for start in range(stop)]
                    assert floors == sorted(floors, reverse=True), (schedule, checkpoint, offload, stop)
                    for start in range(stop):
                        needs = [memory.need(s, start, stop) for s in range(stages)]
                        assert floors[start] <= min(needs), (schedule, checkpoint, offload, start, stop)
                        tight += floors[start] > mm.weights_floor(figures, 16.0)(start, stop)
                unfloored = partition.min_max_split(n, stages, memory.need)
                assert memory.least() == unfloored, (schedule, checkpoint, offload)
                assert unfloored is not None
                memory.capacity = unfloored[0] * 1.01
                costs = [float(i % 3 + 1) for i in range(n)]
                assert memory.within(costs) == partition.balance_within(costs, stages, memory.fits)
    assert tight, "the floor counts activations, not the weights alone"


def test_the_first_stage_holds_the_whole_input_and_the_last_one_micro_batch_s_loss_gradient():
    # The model's input arrives whole and is split into views on the first stage; the loss's backward holds the
    # gradient of one micro-batch's logits (the largest: 30 into 4 is 8, 8, 7, 7).
    layer = mm.LayerFigures("l", 0, mm.Affine(0.0, 10.0), mm.Affine(0.0, 100.0))
    figures = mm.ModelFigures(mm.Affine(0.0, 1000.0), (layer, layer))
    first, last = mm.footprints(figures, [1, 1], 30, 4, "gpipe", "never", 12.0)
    assert first.peak_bytes >= 1000.0 * 30 > last.peak_bytes
    assert (first.loss_bytes, last.loss_bytes) == (0.0, 800.0)
