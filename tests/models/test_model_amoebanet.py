"""AmoebaNet: published parameter counts, shapes, cuts, the auxiliary head and a short training run."""

from __future__ import annotations

import pytest
import torch
from models_testkit import build_layers, check_every_cut, run

from gpipe_cli.models.amoebanet.ops import Pool
from gpipe_cli.models.describe import count_parameters
from gpipe_cli.models.registry import build_model

# (variant, L, D, published count, unit of the last published digit)
PUBLISHED = [
    ("d", 18, 208, 82e6, 1e6),
    ("d", 18, 416, 318e6, 1e6),
    ("d", 18, 544, 542e6, 1e6),
    ("d", 36, 544, 1.05e9, 1e7),
    ("d", 72, 512, 1.8e9, 1e8),
    ("b", 18, 512, 557e6, 1e6),
]


@pytest.mark.parametrize(("variant", "layers", "filters", "published", "digit"), PUBLISHED)
def test_parameter_count_matches_paper(variant: str, layers: int, filters: int, published: float,
                                       digit: float) -> None:
    spec = build_model("amoebanet", variant=variant, layers=layers, filters=filters, num_classes=1000)
    count = count_parameters(spec)
    # 1.5%, or the rounding of the published figure where that is coarser: "1.8B" only says
    # 1.75B-1.85B (AmoebaNet-D(72, 512) has 1.843B parameters; see the module docs).
    tolerance = max(0.015 * published, digit / 2)
    assert abs(count - published) <= tolerance, f"{count / 1e6:.1f}M vs {published / 1e6:.0f}M"


@pytest.mark.parametrize("variant", ["d", "b"])
@pytest.mark.parametrize("size", [32, 37, 64])
def test_forward_shapes_at_any_image_size(variant: str, size: int) -> None:
    spec = build_model("amoebanet", variant=variant, layers=6, filters=16, num_classes=7, image_size=32)
    layers = build_layers(spec)
    logits = run(layers, torch.randn(2, 3, size, size))
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


def test_layers_form_the_documented_sequence() -> None:
    spec = build_model("amoebanet", variant="d", layers=6, filters=16, num_classes=10, aux_head=True)
    cells = ["stem_reduction_1", "stem_reduction_2", "cell_1_1", "cell_1_2", "reduction_1", "cell_2_1", "cell_2_2",
             "reduction_2", "cell_3_1", "cell_3_2"]
    pieces = ["preprocess", "combine_1", "combine_2", "combine_3", "combine_4", "combine_5"]
    layers = [f"{cell}.{piece}" for cell in cells for piece in pieces]
    assert spec.layer_names == ["stem", *layers[:7 * 6], "aux_head", *layers[7 * 6:], "classifier"]
    assert spec.task == "image"


def test_max_pooling_is_real_max_pooling() -> None:
    spec = build_model("amoebanet", variant="d", layers=3, filters=8)
    cell = [layer.build() for layer in spec.layers if layer.name.startswith("cell_1_1.")]  # the first normal cell
    pools = [m for piece in cell for m in piece.modules() if isinstance(m, Pool)]
    assert sorted(p.kind for p in pools) == ["avg", "max", "max"]
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    assert Pool("max", 3, 1, 1, 1)(x)[0, 0, 0, 0] == 5.0
    # Reduction cells' 2x2 max pooling keeps ceil(H/2) so odd maps line up with the other branches.
    assert Pool("max", 2, 2, 1, 1)(torch.randn(1, 1, 5, 5)).shape[-1] == 3


@pytest.mark.parametrize("aux_head", [False, True])
def test_every_cut_and_micro_batch_split_agree(aux_head: bool) -> None:
    spec = build_model("amoebanet", variant="d", layers=6, filters=16, num_classes=5, image_size=32,
                       aux_head=aux_head)
    inputs, _ = spec.example_batch(4, "cpu")
    check_every_cut(spec, inputs, micro_batches=[1, 3])


def test_auxiliary_head_output_and_loss() -> None:
    spec = build_model("amoebanet", variant="b", layers=3, filters=8, num_classes=6, aux_head=True,
                       image_size=48)
    images, labels = spec.example_batch(3, "cpu")
    output = run(build_layers(spec), images)
    assert isinstance(output, tuple) and [t.shape for t in output] == [(3, 6), (3, 6)]
    main_only = spec.loss(output[0], labels)
    assert spec.loss(output, labels) > main_only



def test_the_auxiliary_loss_weighs_four_tenths_of_the_main_one() -> None:
    import torch.nn.functional as F

    # The auxiliary head's loss counted as much as the main one: the reference weighs it 0.4.
    spec = build_model("amoebanet", variant="d", layers=3, filters=8, num_classes=6, aux_head=True, image_size=32)
    torch.manual_seed(0)
    logits, aux, labels = torch.randn(4, 6), torch.randn(4, 6), torch.tensor([0, 1, 2, 5])
    main, side = (F.cross_entropy(x, labels, label_smoothing=0.1) for x in (logits, aux))
    assert spec.loss((logits, aux), labels) == pytest.approx(float(main + 0.4 * side))


def test_the_auxiliary_head_at_224_pixels_is_the_references() -> None:
    # At 224 px the head sees a 14x14 map, pooled to 4x4, of 0.4 x (128, 768) channels; a map side rounded down
    # (13, pooled to 3x3) or the full 768 channels built another head.
    spec = build_model("amoebanet", variant="d", layers=3, filters=8, num_classes=10, aux_head=True, image_size=224)
    head = next(layer for layer in spec.layers if layer.name == "aux_head").build()
    assert head.grid == 4
    assert tuple(head.proj.weight.shape[:2]) == (51, 64) and tuple(head.conv.weight.shape) == (307, 51, 4, 4)
    assert tuple(head.fc.weight.shape) == (10, 307)

def test_example_batch_on_meta() -> None:
    spec = build_model("amoebanet", num_classes=10, image_size=40)
    images, labels = spec.example_batch(2, "meta")
    assert images.shape == (2, 3, 40, 40) and images.dtype == torch.float32 and images.is_meta
    assert labels.shape == (2,) and labels.dtype == torch.int64


@pytest.mark.parametrize(("key", "value"), [("variant", "c"), ("layers", 7), ("filters", 10),
                                            ("image_size", 16), ("dropout", 1.0), ("aux_head", "yes")])
def test_bad_values_raise_value_error(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key.split("_")[0]):
        build_model("amoebanet", **{key: value})


def test_sgd_reduces_loss() -> None:
    torch.manual_seed(0)
    spec = build_model("amoebanet", variant="d", layers=3, filters=8, num_classes=4, image_size=32,
                       dropout=0.0)
    layers = build_layers(spec)
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    images, labels = spec.example_batch(16, "cpu")
    images = images + labels[:, None, None, None].float()  # a learnable signal
    losses = []
    for _ in range(8):
        loss = spec.loss(run(layers, images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
