"""The sweep's plot: ours beside the paper's, from the sweep's own cells, at the expected size."""

from PIL import Image

from gpipe_cli.bench.sweep import PLOT_PX, plot, plot_bars


def summary():
    cells = []
    for k in (2, 4):
        for m in (1, 4, 32):
            cells.append({"partitions": k, "microbatches": m, "normalized": k * m / 10.0, "paper": m / 4.0 + k})
    return {"sweep": cells, "model": {"name": "amoebanet-d-4-8"}, "paper": {"model": "AmoebaNet-D (18, 256)"}}


def test_the_bars_are_the_sweep_cells_and_the_paper_figures():
    groups, bars = plot_bars(summary())
    assert groups == ["M=1", "M=4", "M=32"]
    assert bars["K=4"] == [c["normalized"] for c in summary()["sweep"] if c["partitions"] == 4]
    assert bars["K=2 paper"] == [c["paper"] for c in summary()["sweep"] if c["partitions"] == 2]
    assert set(bars) == {"K=2", "K=2 paper", "K=4", "K=4 paper"}


def test_the_plot_is_a_png_of_the_expected_size(tmp_path):
    path = plot(summary(), tmp_path / "sweep.png")
    assert path is not None
    with Image.open(path) as image:
        assert image.size == PLOT_PX
