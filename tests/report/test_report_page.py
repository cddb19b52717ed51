"""`gpipe report`'s page with many runs: a title within the page, one legend of the runs, no legend over data."""

import pytest
import yaml

from gpipe_cli.pipeline import schedules
from gpipe_cli.report import page
from gpipe_cli.report.runs import read_runs
from tests.report.test_report import make_run


def _runs(tmp_path, count: int, prefix: str = "a-run-folder-of-the-schedule-"):
    """`count` runs, schedules in turn, K of 2 to 8, each in a folder with a long name."""
    folders = []
    for i in range(count):
        schedule = schedules.names()[i % len(schedules.names())]
        folder = make_run(tmp_path / f"{prefix}{schedule}-{i}", 2 + 2 * (i % 4))
        recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
        recipe["pipeline"].update(schedule=schedule, microbatches=32, data_parallel=2)
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        folders.append(folder)
    return read_runs(folders)


def _drawn(tmp_path, monkeypatch, runs):
    """The page's figure as written, and a renderer of it."""
    kept = {}
    monkeypatch.setattr(page.plots, "write", lambda plt, fig, path, dpi: kept.update(fig=fig))
    page.draw(runs, tmp_path / "page.png")
    fig = kept["fig"]
    return fig, fig.canvas.get_renderer()


@pytest.mark.parametrize("count", [1, 2, 7, 10])
def test_the_title_fits_the_page_and_one_legend_names_every_run_over_no_panel(tmp_path, monkeypatch, count):
    # Seven runs: the title ran off both edges, and each panel's legend of every run covered its curves.
    runs = _runs(tmp_path, count)
    fig, renderer = _drawn(tmp_path, monkeypatch, runs)
    title = fig._suptitle.get_window_extent(renderer)
    assert title.x0 >= 0 and title.x1 <= fig.bbox.width and title.y1 <= fig.bbox.height
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and not box.overlaps(title)
    named = [text.get_text() for text in legend.get_texts()]
    assert len(named) == count and all(run.label in name and run.path.name in name for run, name in zip(runs, named))
    for ax in fig.axes:
        assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_title()
        if ax.get_legend() is not None:  # a panel keeps only a key of its own (stage styles, step parts)
            assert not {t.get_text() for t in ax.get_legend().get_texts()} & {run.label for run in runs}


@pytest.mark.parametrize("count", [1, 3, 10])
def test_no_panel_legend_covers_its_data(tmp_path, monkeypatch, count):
    fig, renderer = _drawn(tmp_path, monkeypatch, _runs(tmp_path, count))
    legends = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert {ax.get_title().split(" (")[0] for ax in legends} == {"step time per stage", "memory peak per stage"}
    for ax in legends:
        box = ax.get_legend().get_window_extent(renderer)
        for artist in [*ax.get_lines(), *ax.patches]:
            assert not box.overlaps(artist.get_window_extent(renderer)), ax.get_title()


@pytest.mark.parametrize("count", [2, 7, 10])
def test_the_step_time_labels_do_not_run_into_each_other(tmp_path, monkeypatch, count):
    # One label per bar, "K=4 M=8 interleaved · 2", overlapped its neighbours.
    fig, renderer = _drawn(tmp_path, monkeypatch, _runs(tmp_path, count))
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith("step time")]
    for minor in (False, True):
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels(minor=minor)
                 if t.get_text() and t.get_visible()]
        assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))
        assert all(b.x0 >= 0 and b.x1 <= fig.bbox.width and b.y0 >= 0 for b in boxes)
    names = [t.get_text() for t in ax.get_xticklabels()]
    assert len(names) == count and len(set(names)) == count  # each run's group is named, each apart


def test_the_bubble_title_names_a_formula_only_where_every_run_s_schedule_has_it(tmp_path):
    def title(*names):
        folders = []
        for name in names:
            folder = make_run(tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}", 2)
            recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
            recipe["pipeline"]["schedule"] = name
            (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
            folders.append(folder)
        return page.bubble_title(read_runs(folders)).split("\n")[0]

    assert title("gpipe", "1f1b") == "bubble: measured (line), theory (K-1)/(M+K-1) (dashed)"
    for mixed in (("gpipe", "interleaved"), ("1f1b", "zero-bubble", "zero-bubble-v", "v-half")):
        assert title(*mixed) == "bubble: measured (line), theory of each run's own schedule (dashed)"
    assert title("interleaved") == "bubble: measured (line), theory of its schedule (dashed)"
    assert "(K-1)/(M+K-1)" not in title("zero-bubble")


def test_a_step_axis_ticks_whole_steps_and_stages_drawn_as_points_differ_in_marker(tmp_path, monkeypatch):
    # A lone eval at step 2 was ticked 1.7 to 2.3, and two stages' single points were the same dot.
    fig, _ = _drawn(tmp_path, monkeypatch, read_runs([make_run(tmp_path / "a", 2, steps=2)]))
    steps = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
    assert any(ax.get_title() == "eval accuracy" for ax in steps)
    for ax in steps:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    memory = next(ax for ax in steps if ax.get_title().startswith("memory peak per stage"))
    markers = [line.get_marker() for line in memory.get_lines()]
    assert len(markers) == 2 and len(set(markers)) == 2
    assert [h.get_marker() for h in memory.get_legend().legend_handles] == markers


def test_a_log_axis_is_labelled_in_plain_numbers_not_tex(tmp_path, monkeypatch):
    # With math text off (a run's name may hold a $), the log axis showed `$\\mathdefault{10^{3}}$` as typed.
    folder = make_run(tmp_path / "a", 2, steps=6)
    with (folder / "metrics.jsonl").open("a") as f:  # an eval loss 300x below the first step's: a log scale
        f.write('{"kind": "eval", "step": 6, "loss": 0.01}\n')
    fig, _ = _drawn(tmp_path, monkeypatch, read_runs([folder]))
    logs = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    assert logs, [ax.get_title() for ax in fig.axes]
    labels = [t.get_text() for ax in logs for t in [*ax.get_yticklabels(), *ax.get_yticklabels(minor=True)]]
    assert any(labels) and not any("$" in label or "e-" in label for label in labels), labels
    assert {"0.01", "0.1", "1", "10"} <= set(labels), labels
