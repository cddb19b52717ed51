"""`gpipe report`: series read from metrics.jsonl, the PNG's size, several runs overlaid, clear errors."""

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from gpipe_cli.cli import run as cli
from gpipe_cli.report import page
from gpipe_cli.report.runs import memory_peak, read_runs, series, time_breakdown
from tests.train.test_view import train_record


def make_run(folder: Path, partitions: int, steps: int = 5, cut: bool = False) -> Path:
    """A run directory as `gpipe train` writes it: recipe.yaml and metrics.jsonl (its last line cut short if `cut`)."""
    folder.mkdir(parents=True)
    recipe = {"name": "r", "pipeline": {"partitions": partitions, "microbatches": 4, "schedule": "1f1b"}}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    lines = []
    for step in range(1, steps + 1):
        record = train_record(step=step, stages=partitions, loss=3.0 / step)
        record["samples_per_s"] = 10.0 * step * partitions
        record["mem_peak_bytes"] = [(s + 1) * 1000 * step for s in range(partitions)]
        lines.append(json.dumps(record))
        if step % 2 == 0:
            lines.append(json.dumps({"kind": "eval", "step": step, "loss": 2.0 / step, "accuracy": 0.1 * step}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + ('\n{"kind": "tra' if cut else "\n"))
    return folder


def test_the_plotted_series_are_the_values_of_metrics_jsonl(tmp_path):
    folder = make_run(tmp_path / "a", partitions=3, cut=True)
    (run,) = read_runs([folder])
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()[:-1]]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    data = series(run)
    assert data["loss"] == ([r["step"] for r in train], [r["loss"] for r in train])
    steady = train[1:]  # the timing figures leave out the first step, which warms up
    assert data["samples_per_s"] == ([r["step"] for r in steady], [r["samples_per_s"] for r in steady])
    assert data["bubble"] == ([r["step"] for r in steady], [r["bubble"] for r in steady])
    assert data["bubble_theory"][1] == [r["bubble_theory"] for r in steady]
    assert data["eval_accuracy"] == ([r["step"] for r in evals], [r["accuracy"] for r in evals])
    assert data["mem_peak_bytes/stage2"][1] == [r["mem_peak_bytes"][2] for r in train]
    wait = time_breakdown(run)["wait"]
    assert wait == pytest.approx([sum(r["time_s"]["wait"][s] for r in steady) / len(steady) for s in range(3)])
    assert run.label == "K=3 M=4 1f1b"


def test_two_runs_make_one_page_of_the_expected_size_with_a_legend_entry_each(tmp_path, capsys):
    a, b = make_run(tmp_path / "a", 2), make_run(tmp_path / "b", 4)
    out = tmp_path / "page.png"
    assert cli(["report", str(a), str(b), "--output", str(out)]) == 0
    with Image.open(out) as image:
        assert image.size == (page.WIDTH_PX, page.HEIGHT_PX)
    shown = capsys.readouterr().out
    assert "K=2 M=4 1f1b" in shown and "K=4 M=4 1f1b" in shown and str(out) in shown
    # Neither was resumed: the caption spoke of "each resume" all the same.
    assert "mean over the steps after the first of each run, which warm up; each step" in " ".join(shown.split())


@pytest.mark.parametrize(("name", "starts"), [("page.pdf", b"%PDF-"), ("page.svg", b"<?xml"), ("PAGE.PNG", b"\x89PNG")])
def test_the_page_is_written_in_the_format_its_name_says(tmp_path, name, starts):
    out = tmp_path / name
    assert cli(["report", str(make_run(tmp_path / "a", 2)), "--output", str(out)]) == 0
    assert out.read_bytes().startswith(starts)  # a .pdf or .svg name held PNG bytes


def test_runs_with_the_same_pipeline_are_told_apart_by_folder(tmp_path):
    runs = read_runs([make_run(tmp_path / "one", 2), make_run(tmp_path / "two", 2)])
    assert [r.label for r in runs] == ["K=2 M=4 1f1b (one)", "K=2 M=4 1f1b (two)"]


def test_runs_in_folders_named_with_a_newline_or_an_undecodable_byte_make_a_page(tmp_path, capsys):
    # matplotlib refused the legend's undecodable byte with a traceback, and the caption split at the newline.
    odd = [tmp_path / os.fsdecode(name) for name in (b"new\nline", b"b\xffd")]
    runs = [make_run(path, 2) for path in odd]
    out = tmp_path / "page.png"
    assert cli(["report", *map(str, runs), "--output", str(out)]) == 0
    assert out.stat().st_size > 0 and "$'new\\nline'" in capsys.readouterr().out
    assert [r.label for r in read_runs(runs)] == ["K=2 M=4 1f1b ($'new\\nline')", "K=2 M=4 1f1b ($'b\\xffd')"]


def test_one_run_writes_its_page_into_the_run_directory(tmp_path):
    folder = make_run(tmp_path / "a", 1)
    assert cli(["report", str(folder)]) == 0
    assert (folder / "report.png").stat().st_size > 0


def test_a_run_given_twice_is_one_run(tmp_path, capsys, monkeypatch):
    # It showed two identical runs, told apart by the same folder name, and wrote report.png where gpipe ran.
    folder = make_run(tmp_path / "a", 2)
    monkeypatch.chdir(tmp_path)
    assert cli(["report", str(folder), "a/", "./a"]) == 0
    out = capsys.readouterr().out
    assert "K=2 M=4 1f1b" in out and "(a)" not in out  # one run: no folder needed to tell it apart
    assert (folder / "report.png").is_file() and not (tmp_path / "report.png").exists()


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err and "Traceback" not in err


@pytest.mark.parametrize("where, says", [("missing", "no such run directory"),
                                         ("metrics.jsonl", "is a file, not a run directory; give the folder")])
def test_a_path_that_is_no_folder_is_named_as_what_it_is(tmp_path, capsys, where, says):
    (tmp_path / "metrics.jsonl").write_text("")
    assert cli(["report", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


@pytest.mark.timeout(20)  # a FIFO read as the records would wait for a writer for ever
@pytest.mark.parametrize("kind, says", [("directory", "is a directory, not a run's records file"),
                                        ("fifo", "is a pipe, socket or device, not a run's records file")])
def test_a_metrics_jsonl_that_is_no_file_is_named_as_what_it_is(tmp_path, capsys, kind, says):
    # A directory was "not a run directory (no metrics.jsonl)", although there is one.
    (tmp_path / "metrics.jsonl").mkdir() if kind == "directory" else os.mkfifo(tmp_path / "metrics.jsonl")
    assert cli(["report", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {tmp_path / 'metrics.jsonl'}: {says}; give the folder `gpipe train` wrote\n"
    assert captured.out == "" and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_without_matplotlib_the_table_still_shows_and_one_line_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    folder = make_run(tmp_path / "a", 2)
    assert cli(["report", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "K=2 M=4 1f1b" in captured.out and "gpipe-cli[plot]" in captured.err
    assert not (folder / "report.png").exists()


def test_warm_up_steps_are_left_out_of_the_throughput_and_bubble_axes_and_the_stage_means(tmp_path):
    folder = make_run(tmp_path / "a", partitions=2, steps=7, cut=True)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()[:-1]]
    for record in records:
        if record["kind"] == "train" and record["step"] in (1, 5):  # the run's first step and the first after a resume
            record.update(warmup=True, samples_per_s=1.0, bubble=0.9)
            record["time_s"]["wait"] = [9.0, 9.0]
            record["resumed"] = record["step"] == 5
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = read_runs([folder])
    data = series(run)
    assert data["samples_per_s"][0] == data["bubble"][0] == [2, 3, 4, 6, 7]
    assert data["loss"][0] == [1, 2, 3, 4, 5, 6, 7]  # a warm-up step's loss is as good as any
    assert max(time_breakdown(run)["wait"]) < 9.0
    lone = read_runs([make_run(tmp_path / "b", partitions=2, steps=1)])[0]
    assert series(lone)["bubble"][0] == [1]  # a run of one step: that step is all there is


def _titles(runs) -> dict[str, str]:
    """Each panel's title, by panel name, as the page draws it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    for name, panel in page.panels(runs):
        fig, ax = plt.subplots()
        panel(ax, runs)
        out[name] = ax.get_title()
        plt.close(fig)
    return out


def test_a_run_of_one_step_says_its_figures_are_of_that_warm_up_step(tmp_path, capsys, monkeypatch):
    # The per-stage table said "mean over the steps after warm-up": its only step is the warm-up step.
    lone = make_run(tmp_path / "lone", 2, steps=1)
    assert cli(["report", str(lone)]) == 0
    out = capsys.readouterr().out
    assert "per stage (mean over the training steps)" in out and "after warm-up" not in out
    assert "samples/s, bubble and wait: mean over the training steps" in out  # the run table's words, as before
    titles = _titles(read_runs([lone]))
    assert titles["step time"] == "step time per stage (warm-up steps only: there are no others)"
    assert titles["throughput"] == "throughput (warm-up steps only: there are no others)"
    assert titles["bubble"].endswith("\nwarm-up steps only: there are no others")
    # Beside a run with steps after warm-up, the one-step run is named as the exception.
    monkeypatch.chdir(tmp_path)
    longer = make_run(tmp_path / "longer", 2)
    assert cli(["report", str(lone), str(longer)]) == 0
    out = capsys.readouterr().out
    assert "per stage (mean over the steps after warm-up; K=2 M=4 1f1b (lone): its warm-up step, all it has)" in out
    titles = _titles(read_runs([lone, longer]))
    assert titles["step time"].startswith("step time per stage (warm-up steps left out where there are others)")
    assert titles["throughput"] == "throughput (warm-up steps left out where there are others)"
    assert _titles(read_runs([longer]))["throughput"] == "throughput (warm-up steps left out)"  # as it was


def make_translation_run(folder: Path, steps: int = 4) -> Path:
    """A translation run: train records with tokens, model FLOPs and MFU; evals with BLEU and perplexity."""
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"name": "t", "pipeline": {"partitions": 2}}))
    lines = []
    for step in range(1, steps + 1):
        lines.append(json.dumps({**train_record(step=step, loss=4.0 / step), "tflops": 0.001 * step,
                                 "mfu": 0.01 * step}))
        lines.append(json.dumps({"kind": "eval", "step": step, "loss": 3.0 / step, "accuracy": 0.1 * step,
                                 "perplexity": math.exp(3.0 / step), "bleu": 5.0 * step}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_bleu_perplexity_and_mfu_get_their_own_panels_when_the_records_hold_them(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (text,) = read_runs([make_translation_run(tmp_path / "t")])
    data = series(text)
    assert data["perplexity"][1] == pytest.approx([math.exp(4.0 / s) for s in range(1, 5)])  # exp(train loss)
    assert data["eval_bleu"] == ([1, 2, 3, 4], [5.0, 10.0, 15.0, 20.0])
    assert data["mfu"] == ([2, 3, 4], [0.02, 0.03, 0.04])  # the warm-up step left out, as for throughput
    chosen = page.panels([text])
    assert [name for name, _ in chosen] == ["loss", "accuracy", "bleu", "perplexity", "throughput", "model flops",
                                            "bubble", "step time", "memory"]
    fig, axes = plt.subplots(1, len(chosen))
    for (_, panel), ax in zip(chosen, axes):
        panel(ax, [text])
    titles = [ax.get_title() for ax in axes]
    plt.close(fig)
    assert titles[2] == "eval BLEU" and titles[3].startswith("perplexity") and titles[5].startswith("MFU")
    assert all(titles)
    out = tmp_path / "page.png"
    assert page.draw([text], out) == out
    with Image.open(out) as image:
        assert image.size == (page.WIDTH_PX, page.HEIGHT_PX)
    # An image run without FLOP counts or text keeps the six panels it always had.
    (image_run,) = read_runs([make_run(tmp_path / "a", 2)])
    image_run.train = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in image_run.train]
    assert [name for name, _ in page.panels([image_run])] == ["loss", "accuracy", "throughput", "bubble",
                                                             "step time", "memory"]


def test_a_memory_curve_of_one_point_is_drawn_with_a_marker(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs([make_run(tmp_path / "one", 2, steps=1)])
    figure, ax = plt.subplots()
    page._memory(ax, runs)
    assert [line.get_marker() for line in ax.get_lines()] == ["o", "s"]  # a lone point: no line
    plt.close(figure)


def test_the_page_keeps_to_three_columns_and_names_each_folder_once(tmp_path, monkeypatch):
    # Seven panels were laid out in four columns, their titles running into each other; two runs alike were
    # titled "K=2 M=4 1f1b (a) (a)".
    a, b = make_run(tmp_path / "a", 2), make_run(tmp_path / "b", 2)
    seen = {}
    real = page.plots.figure

    def figure(plt, width, height, rows, cols, title):
        seen.update(rows=rows, cols=cols, title=title)
        return real(plt, width, height, rows, cols, title)

    monkeypatch.setattr(page.plots, "figure", figure)
    assert cli(["report", str(a), str(b), "--output", str(tmp_path / "page.png")]) == 0
    assert seen["cols"] <= 3 and seen["rows"] * seen["cols"] >= len(page.panels(read_runs([a, b])))
    assert seen["title"] == "gpipe report: K=2 M=4 1f1b (a), K=2 M=4 1f1b (b)"


def test_a_language_models_perplexity_panel_draws_its_unigram_baseline(tmp_path):
    # The records held unigram_perplexity, the figure a language model must get below; the page never showed it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = make_translation_run(tmp_path / "lm")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if record["kind"] == "eval":
            record["unigram_perplexity"] = 500.0
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = read_runs([folder])
    assert series(run)["eval_unigram_perplexity"] == ([1, 2, 3, 4], [500.0] * 4)
    fig, ax = plt.subplots()
    dict(page.panels([run]))["perplexity"](ax, [run])
    plt.close(fig)
    assert "unigram baseline: dotted" in ax.get_title()
    assert any(list(line.get_ydata()) == [500.0] * 4 and line.get_linestyle() == ":" for line in ax.get_lines())
    # A run evaluated once still shows it, across the panel (a dotted line through one point drew nothing).
    once = [r for r in records if r["kind"] != "eval" or r["step"] == 4]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in once))
    (run,) = read_runs([folder])
    fig, ax = plt.subplots()
    dict(page.panels([run]))["perplexity"](ax, [run])
    fig.canvas.draw()
    plt.close(fig)
    (baseline,) = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert set(baseline.get_ydata()) == {500.0} and list(baseline.get_xdata()) == [0, 1]  # axis-wide
    assert ax.get_ylim()[0] < 500.0 < ax.get_ylim()[1]


@pytest.mark.parametrize(("figures", "shown"), [
    ({"accuracy": 0.5}, "acc 0.5"),  # images
    ({"accuracy": 0.31, "perplexity": 12.5}, "ppl 12.5"),  # a language model: it showed its token accuracy
    ({"accuracy": 0.31, "perplexity": 12.5, "bleu": 20.25}, "BLEU 20.2"),  # a translation
])
def test_the_table_shows_the_eval_figure_a_task_is_judged_by(tmp_path, capsys, figures, shown):
    from gpipe_cli.report import summary_table

    folder = make_run(tmp_path / "a", 2)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "eval", "step": 5, "loss": 0.1, **figures}) + "\n")
    table = summary_table(read_runs([folder]))
    assert list(table.columns[3].cells) == [f"0.1 @5, {shown}"]


def test_a_run_whose_last_loss_was_not_finite_shows_nan_not_an_earlier_loss(tmp_path):
    # A run skipping non-finite steps showed step 2's 3.5e16 as its loss, with no sign of the NaN after it.
    from gpipe_cli.report import summary_table

    folder = make_run(tmp_path / "a", 2)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**train_record(step=6, stages=2), "loss": None, "nonfinite": ["loss"]}) + "\n")
    assert list(summary_table(read_runs([folder])).columns[2].cells) == ["nan"]
    assert list(summary_table(read_runs([make_run(tmp_path / "b", 2)])).columns[2].cells) == ["0.6000"]


def test_a_run_stopped_short_of_its_steps_and_its_skipped_steps_are_counted(tmp_path):
    # A run stopped at step 5 of 200 read "5", as a finished one does; one whose steps were skipped said nothing.
    from gpipe_cli.report import summary_table

    folder = make_run(tmp_path / "a", 2)
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    (folder / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "train": {"steps": 200, "epochs": None}}))
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**train_record(step=6, stages=2), "skipped": True}) + "\n")
    assert list(summary_table(read_runs([folder])).columns[1].cells) == ["6 of 200 (1 skipped)"]
    (folder / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "train": {"steps": 200, "epochs": 1}}))
    assert list(summary_table(read_runs([folder])).columns[1].cells) == ["6 (1 skipped)"]  # epochs may end it


def test_a_course_a_resume_set_aside_says_which_steps_it_holds_and_whose_they_follow(tmp_path, capsys):
    # Its table gave "steps 8" and a warm-up "first" step that was the resume's, not the run's first.
    run_dir = make_run(tmp_path / "run", 2, steps=6)
    course = run_dir / "checkpoints" / "superseded-20261206-182218-at-step-6"
    course.mkdir(parents=True)
    records = [train_record(step=step, stages=2) | ({"resumed": True, "warmup": True} if step == 7 else {})
               for step in (7, 8)]
    (course / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli(["report", str(course), "--output", str(tmp_path / "course.png")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"(a course a resume set aside: steps 7-8, after the steps of {run_dir})" in out
    assert cli(["report", str(run_dir), "--output", str(tmp_path / "run.png")]) == 0
    assert "set aside" not in capsys.readouterr().out


def test_a_run_whose_records_hold_no_memory_peak_shows_none_not_zero_bytes(tmp_path, capsys):
    # A course of steps whose stages read no peak was reported as holding 0 B.
    folder = make_run(tmp_path / "a", partitions=2)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("mem_peak_bytes", None)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = read_runs([folder])
    assert memory_peak(run) is None
    assert cli(["report", str(folder), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert " 0 B " not in out and re.search(r"│ +- +│?\s*$", out, re.MULTILINE)


def test_the_tables_show_the_lowest_eval_each_stage_s_own_times_and_a_peak_only_the_first_step_read(tmp_path):
    from gpipe_cli.report import stage_table, summary_table
    from gpipe_cli.report.runs import PARTS
    from gpipe_cli.units import human_bytes

    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"name": "r", "pipeline": {"partitions": 2}}))
    records = []
    for step in range(1, 7):
        record = train_record(step=step, stages=2)
        record.pop("mem_peak_bytes")
        if step == 1:  # a run shorter than 10 steps counts its activations on its first step alone
            record["mem_peak_bytes"] = [1 << 20, 5 << 20]
        records.append(record)
        if step % 2 == 0:
            records.append({"kind": "eval", "step": step, "loss": {2: 2.0, 4: 1.0, 6: 1.5}[step]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = read_runs([folder])
    summary = summary_table(runs)
    assert list(summary.columns[3].cells) == ["1 @4"]  # the lowest loss, not the last evaluation's
    assert list(summary.columns[-1].cells) == [human_bytes(5 << 20)]
    stages = stage_table(runs)
    for k, part in enumerate(PARTS[:-1]):  # train_record gives stage i's part k 10 x (i + 1) x (k + 1) ms
        assert list(stages.columns[2 + k].cells) == [f"{10.0 * (k + 1):.1f}", f"{20.0 * (k + 1):.1f}"], part
    assert list(stages.columns[-1].cells) == [human_bytes(1 << 20), human_bytes(5 << 20)]


@pytest.mark.parametrize("failure", ["absent", "broken"])
def test_without_a_usable_matplotlib_the_tables_are_shown_and_one_line_says_why(tmp_path, capsys, monkeypatch,
                                                                                 failure):
    # Built for NumPy 1 under NumPy 2, matplotlib was said to be "not installed".
    import builtins

    from gpipe_cli import plots

    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            if failure == "absent":
                raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
            raise ImportError("numpy.core.multiarray failed to import")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    monkeypatch.setattr(plots, "_why_not", plots._why_not)
    assert cli(["report", str(make_run(tmp_path / "a", 2)), "--output", str(tmp_path / "page.png")]) == 1
    out, err = capsys.readouterr()
    assert "K=2 M=4 1f1b" in out and not (tmp_path / "page.png").exists()
    why = ("matplotlib is not installed (pip install 'gpipe-cli[plot]')" if failure == "absent" else
           "matplotlib is installed but cannot be imported (numpy.core.multiarray failed to import); reinstall it "
           "(pip install -U 'gpipe-cli[plot]')")
    assert err == f"gpipe report: {why}; no page written\n"
