"""describe(): per-layer parameters, FLOPs and cut sizes on the meta device, for any ModelSpec."""

from __future__ import annotations

import pytest
from models_testkit import build_preset

from gpipe_cli.models.describe import LayerCost, ModelSummary, count_parameters, describe, layer_params
from gpipe_cli.models.registry import build_model

SPECS = {
    "amoebanet": dict(kind="amoebanet", variant="d", layers=6, filters=16, num_classes=10,
                      image_size=32, aux_head=True),
    "translation": dict(kind="transformer", layers=2, d_model=32, ff=64, heads=4, vocab_size=50,
                        max_len=12, tie_embeddings=True),
    "lm": dict(kind="transformer", arch="decoder-only", layers=2, d_model=32, ff=64, heads=4,
               vocab_size=50, max_len=12),
}


@pytest.mark.parametrize("which", list(SPECS))
def test_every_layer_has_costs(which: str) -> None:
    params = dict(SPECS[which])
    spec = build_model(str(params.pop("kind")), **params)
    summary = describe(spec, batch_size=3)
    assert isinstance(summary, ModelSummary) and summary.batch_size == 3
    assert [c.name for c in summary.layers] == spec.layer_names
    for cost in summary.layers:
        assert isinstance(cost, LayerCost)
        assert cost.flops > 0, cost.name
        assert cost.activation_bytes > 0, cost.name
        assert all(shape[0] == 3 for shape in cost.output_shapes), cost.name
    assert summary.total_flops == sum(c.flops for c in summary.layers)
    assert summary.total_params == count_parameters(spec)
    assert [c.params for c in summary.layers] == layer_params(spec)
    assert summary.input_bytes > 0  # what the cut before the first layer carries


def test_costs_match_a_real_forward() -> None:
    spec = build_model("transformer", arch="decoder-only", layers=1, d_model=16, ff=32, heads=2,
                       vocab_size=20, max_len=8)
    summary = describe(spec, batch_size=2)
    # Embedding output: states [8, 16] float32 plus the keep mask [8] bool, per example.
    assert summary.layers[0].activation_bytes == 8 * 16 * 4 + 8
    assert summary.layers[-1].activation_bytes == 8 * 20 * 4
    # The softmax projection alone is 2 * T * d * V FLOPs per example.
    assert summary.layers[-1].flops >= 2 * 8 * 16 * 20
    per_example = describe(spec, batch_size=5).layers[1].flops
    assert per_example == summary.layers[1].flops


def test_larger_images_change_the_estimate() -> None:
    spec = build_model("amoebanet", variant="b", layers=3, filters=8, num_classes=10, image_size=32)
    small = describe(spec, batch_size=2)
    large = describe(build_model("amoebanet", variant="b", layers=3, filters=8, num_classes=10, image_size=64), 2)
    assert large.total_flops > 3 * small.total_flops
    assert large.total_params == small.total_params


def test_huge_models_are_described_without_allocating() -> None:
    summary = describe(build_preset("transformer-l-103", max_len=32), batch_size=1)
    assert summary.total_params > 5e9
    assert summary.layers[1].activation_bytes == 32 * 2048 * 4 + 32
    assert summary.layers[0].params == 32000 * 2048


def test_alike_amoebanet_cells_are_traced_once(monkeypatch) -> None:
    # Each cell's plan carried its name, so no two cells' layers were alike: 300 cells took minutes to price.
    from gpipe_cli.models.amoebanet import network

    built: list[str] = []
    piece = network._build_piece
    monkeypatch.setattr(network, "_build_piece", lambda *args: (built.append(args[1].name), piece(*args))[1])
    shallow = describe(build_model("amoebanet", layers=6, filters=8, num_classes=10, image_size=32), 2)
    traced = len(built)
    deep = describe(build_model("amoebanet", layers=60, filters=8, num_classes=10, image_size=32), 2)
    # Ten times the cells, a few more traced: a stack's first cells differ in their inputs, the rest are alike.
    assert len(deep.layers) > 5 * len(shallow.layers) and len(built) - traced < 1.5 * traced
    # Priced once, counted for every cell.
    cell = [layer for layer in deep.layers if layer.name.startswith("cell_1_")]
    assert len({(layer.flops, layer.params) for layer in cell if layer.name.endswith(".combine_1")}) == 1
    assert deep.total_params > 8 * shallow.total_params
