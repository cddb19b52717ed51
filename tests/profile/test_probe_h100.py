"""The device correction against what one H100 80GB (torch 2.11, 2026-11-27) read: fitted to its probe steps'
allocator peaks, it predicts the Table 1 members trained there."""

import pytest

from gpipe_cli.memory_model import bytes_per_parameter, footprints
from gpipe_cli.profile import budget, probe

PER_PARAM = bytes_per_parameter("rmsprop")
TRANSFORMER_L = dict(budget.TransformerL.PAPER, d_model=2048, ff=8192, heads=32, vocab_size=32000, max_len=1024)
AMOEBANET_D = dict(budget.AmoebaNetD.PAPER, image_size=224, num_classes=1000)
GiB = 2**30


@pytest.fixture(scope="module")
def transformer():
    return budget.TransformerL(TRANSFORMER_L, shapes_only=True)


def _one_stage(figures, batch, m, checkpoint):
    return footprints(figures, [len(figures.layers)], batch, m, "gpipe", checkpoint, PER_PARAM)[0]


def _transformer(family, layers, batch, m, checkpoint):
    return _one_stage(family.figures(layers), batch, m, checkpoint)


def test_transformer_probes_grown_past_the_update_predict_the_trained_members(transformer):
    # (layers, batch, M, checkpoint, reserved peak): the probes as a device of 80 GB grows them, then the members.
    probes = [(1, 16, 1, "never", 11.935e9), (2, 16, 1, "never", 15.565e9), (1, 32, 1, "never", 21.794e9),
              (1, 128, 8, "except_last", 14.307e9), (2, 128, 8, "except_last", 17.937e9),
              (1, 256, 8, "except_last", 26.24e9)]
    correction = probe.fit([(_transformer(transformer, *p[:4]), p[3], p[4]) for p in probes])
    assert correction.worst_error() < 0.05 and set(correction.loss) == {"never", "remat"}
    for layers, batch, m, checkpoint, measured in [(3, 32, 1, "never", 35.029e9), (9, 32, 8, "except_last", 17.855e9),
                                                   (1, 32, 8, "except_last", 5.522e9)]:
        predicted = correction.bytes(_transformer(transformer, layers, batch, m, checkpoint), checkpoint)
        assert predicted == pytest.approx(measured, rel=0.06), (layers, checkpoint, predicted / measured)
    rows = [("naive-1", 1, 1, "never"), ("pipeline-1", 1, 8, "except_last")]
    naive, remat = budget.search(transformer, rows, 16 * GiB, 32, "gpipe", "rmsprop", correction=correction)
    # Without remat not even one layer fits 16 GiB (one layer trained at 21.8 GB); with it, 8 (9 peaked at 17.9 GB).
    assert naive is None and remat is not None and remat.model == "8"


def test_transformer_probes_at_one_example_cannot_see_the_activations(transformer):
    probes = [(1, 1, 1, "never", 3.693e9), (2, 1, 1, "never", 4.681e9), (1, 2, 1, "never", 3.693e9)]
    correction = probe.fit([(_transformer(transformer, *p[:4]), p[3], p[4]) for p in probes])
    assert correction.unseen == ("never",) and correction.activations == {"never": 1.0}


def test_amoebanet_probes_predict_the_trained_members():
    family = budget.AmoebaNetD(AMOEBANET_D)
    # (filters, batch, M, checkpoint, reserved peak) of the 6-cell probes; the members trained at batch 128.
    probes = [(16, 2, 1, "never", 50331648), (32, 2, 1, "never", 94371840), (16, 4, 1, "never", 90177536),
              (16, 16, 8, "except_last", 52428800), (32, 16, 8, "except_last", 96468992),
              (16, 32, 8, "except_last", 113246208)]

    def stage(layers, filters, batch, m, checkpoint):
        return _one_stage(family.figures(layers, filters), batch, m, checkpoint)

    correction = probe.fit([(stage(6, *p[:4]), p[3], p[4]) for p in probes])
    assert correction.loss == {}  # 1,000 classes weigh nothing beside the cells' feature maps
    for (layers, filters), m, checkpoint, measured in [((6, 80), 1, "never", 8264876032),
                                                        ((6, 464), 8, "except_last", 7392460800)]:
        predicted = correction.bytes(stage(layers, filters, 128, m, checkpoint), checkpoint)
        assert predicted == pytest.approx(measured, rel=0.03), (filters, checkpoint, predicted / measured)
