"""The sweep's plot and table: ours beside the paper's, from the sweep's own cells; the K left out, and why."""

from PIL import Image
from rich.console import Console

from gpipe_cli.bench import BenchOptions, setup
from gpipe_cli.bench.sweep import PLOT_PX, plot, plot_bars, show


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


def test_each_k_left_out_says_why(monkeypatch):
    monkeypatch.setattr(setup, "oversubscription", lambda ranks, threads: (ranks > 2, "2 CPU cores"))
    hosts = "more ranks than this machine hosts (--oversubscribe runs them anyway)"
    model = "the model has 4 pipeline layers, fewer than K"
    assert setup.sweep_skipped(BenchOptions(sweep=True), 4) == {4: hosts, 8: model}
    # --oversubscribe runs K=4; K=8 stays out, and not for want of ranks.
    assert setup.sweep_skipped(BenchOptions(sweep=True, oversubscribe=True), 4) == {8: model}
    assert setup.sweep_skipped(BenchOptions(sweep=True, oversubscribe=True), 8) == {}
    console = Console(width=200, record=True)
    show({**summary(), "batch_size": 128, "schedule": "gpipe", "checkpoint": "except_last", "contended": False,
          "normalized_to": None, "oversubscribed": False, "skipped_why": {8: model}}, console)
    printed = console.export_text()
    assert "K = 8 skipped: the model has 4 pipeline layers, fewer than K" in printed and "hosts" not in printed
