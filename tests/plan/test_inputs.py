import pytest

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate.costs import CostProfile, LayerTiming
from gpipe_cli.models.registry import build_model
from gpipe_cli.plan import inputs


def profile(size: int, fixed: float, per: float) -> CostProfile:
    seconds = fixed + per * size
    return CostProfile(size, 10 * size, 0.1 * seconds,
                       [LayerTiming(f"l{i}", seconds, 0.8 * seconds, 2 * seconds, 100 * size) for i in range(3)])


def test_affine_costs_pass_through_both_measured_sizes_and_keep_the_fixed_part():
    lo, hi = profile(2, 0.5, 0.1), profile(16, 0.5, 0.1)
    at = inputs.affine_costs(lo, hi)
    for measured in (lo, hi):
        assert at(measured.microbatch_size) == measured
    middle = at(8)
    assert middle.layers[0].forward == pytest.approx(0.5 + 0.8)
    assert middle.layers[0].output_bytes == 800 and middle.input_bytes == 80
    # The fixed part makes eight micro-batches of one cost more than one of eight.
    assert 8 * at(1).layers[0].forward > at(8).layers[0].forward


def test_estimated_costs_grow_with_flops_and_examples():
    figs = mm.ModelFigures(mm.Affine(0, 4), tuple(mm.LayerFigures(f"l{i}", 1, mm.ZERO, mm.Affine(0, 8))
                                                  for i in range(2)))
    at = inputs.estimated_costs(["a", "b"], [1e9, 3e9], figs, rate=1e12, per_call=1e-4)
    one, four = at(1), at(4)
    assert one.layers[1].forward > one.layers[0].forward
    assert four.layers[0].forward - one.layers[0].forward == pytest.approx(3e9 / 1e12)
    assert one.layers[0].backward == pytest.approx(2 * one.layers[0].forward)
    assert four.layers[0].output_bytes == 32


def test_a_deep_model_is_priced_by_the_kinds_of_its_layers():
    params = dict(arch="decoder-only", layers=6, d_model=16, ff=32, heads=2, vocab_size=64, max_len=8)
    spec = build_model("transformer", **params)
    extrapolated, flops, note = inputs.figures("transformer", params, spec)
    exact = mm.measure(spec, 0, device="meta")
    assert "extrapolated" in note and len(flops) == len(spec.layers)
    assert [layer.name for layer in extrapolated.layers] == spec.layer_names
    for a, b in zip(extrapolated.layers, exact.layers):
        assert a.params == b.params
        assert a.saved.at(4) == pytest.approx(b.saved.at(4))
        assert a.output.at(4) == pytest.approx(b.output.at(4))
