"""The memory model: per-layer figures from shapes equal measured ones; capacity per rank; the walk's trends."""

import pytest

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
