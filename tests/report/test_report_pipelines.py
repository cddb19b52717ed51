"""`gpipe report` on a run resumed with another pipeline: each start under its own K, M and schedule, and no
per-stage figure averaged over stages of different cuts."""

import json
import re

import pytest
import yaml

from gpipe_cli.cli import run as cli
from gpipe_cli.report.runs import read_runs, series, time_breakdown
from gpipe_cli.train.sinks import scalars
from tests.train.test_view import train_record

# (first step, steps, K, M): trained at K=2 M=4, stopped, resumed at K=3 M=8.
STARTS = ((1, 5, 2, 4), (6, 3, 3, 8))


def start_records(first, steps, k, m, pipeline=True):
    """One `gpipe train`'s records: its stages' wait and memory tell the cut apart (K=2: 9 s and 2 GiB a stage)."""
    records = []
    for step in range(first, first + steps):
        record = train_record(step=step, stages=k)
        record["time_s"]["wait"] = [9.0 if k == 2 else 0.1] * k
        record["mem_peak_bytes"] = [(2 << 30) if k == 2 else (s + 1) << 20 for s in range(k)]
        if pipeline:
            record.update(microbatches=m, schedule="gpipe", data_parallel=1)
        records.append(record)
    records[0]["warmup"] = True
    records[0]["resumed"] = first > 1
    return records


def resumed_run(folder, pipeline=True):
    """A run directory whose recipe.yaml is the last start's (K=3 M=8), as `gpipe train --resume` leaves it."""
    folder.mkdir()
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"name": "r", "pipeline": {"partitions": 3, "microbatches": 8}}))
    records = [r for start in STARTS for r in start_records(*start, pipeline=pipeline)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_each_start_is_labelled_by_its_own_pipeline(tmp_path, capsys):
    run = resumed_run(tmp_path / "run")
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"K=2 M=4 gpipe +│ +1-5 +│", out), out  # the report said K=3 M=8 for steps 1-5
    assert re.search(r"K=3 M=8 gpipe +│ +6-8 +│", out), out
    assert read_runs([run])[0].label == "K=3 M=8 gpipe"  # the run: its pipeline now


def test_the_per_stage_figures_are_the_last_pipelines_alone(tmp_path, capsys):
    (run,) = read_runs([resumed_run(tmp_path / "run")])
    assert time_breakdown(run)["wait"] == pytest.approx([0.1] * 3)  # stages 0 and 1 averaged K=2's 9 s in
    data = series(run)
    assert [data[f"mem_peak_bytes/stage{s}"] for s in range(3)] == [([6, 7, 8], [float((s + 1) << 20)] * 3)
                                                                     for s in range(3)]
    assert cli(["report", str(run.path), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert "K=3 M=8 gpipe: steps 6-8 only, its last pipeline" in out
    stage1 = next(line for line in out.splitlines() if re.search(r"│ +1 +│", line))
    assert "2.0 GiB" not in stage1 and "2.0 MiB" in stage1  # stage 1's peak showed the K=2 cut's 2 GiB
    assert "2.0 GiB" in out  # the run's largest peak, in the summary, is of every step


def test_records_without_their_pipeline_take_the_stages_they_hold_and_the_recipes_m(tmp_path, capsys):
    (run,) = read_runs([resumed_run(tmp_path / "run", pipeline=False)])
    assert [run.pipeline(r) for r in (run.train[0], run.train[-1])] == ["K=2 M=8 gpipe", "K=3 M=8 gpipe"]
    assert time_breakdown(run)["wait"] == pytest.approx([0.1] * 3)


def test_records_of_a_version_before_the_pipeline_was_recorded_are_not_given_a_later_starts_recipe(tmp_path,
                                                                                                  capsys):
    # An old run resumed by a later version at M=8 1f1b: its steps at M=4 gpipe were labelled M=8 1f1b, being
    # read from the recipe.yaml the resume had rewritten, and the whole run's figures blended both pipelines.
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"name": "r", "pipeline": {"partitions": 2, "microbatches": 8,
                                                                                  "schedule": "1f1b"}}))
    records = start_records(1, 5, 2, 4, pipeline=False) + start_records(6, 3, 2, 8)
    for record in records[5:]:
        record["schedule"] = "1f1b"
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = read_runs([folder])
    assert [run.pipeline(r) for r in (run.train[0], run.train[-1])] == ["K=2 (M and schedule unrecorded)",
                                                                        "K=2 M=8 1f1b"]
    assert cli(["report", str(folder), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"K=2 \(M and schedule unrecorded\) +│ +1-5 +│", out), out
    assert re.search(r"K=2 M=8 1f1b +│ +6-8 +│", out), out
    assert "8 (M and schedule unrecorded before 6)" in out and "pipeline changed" not in out  # it may not have


def test_a_run_resumed_with_its_pipeline_unchanged_keeps_every_step_in_its_stage_figures(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    records = start_records(1, 3, 3, 8) + start_records(4, 3, 3, 8)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = read_runs([folder])
    assert series(run)["mem_peak_bytes/stage0"][0] == [1, 2, 3, 4, 5, 6]
    assert run.label == "K=3 M=8 gpipe"  # no recipe.yaml: the records say it
    assert cli(["report", str(folder), "--output", str(tmp_path / "page.png")]) == 0
    assert "last pipeline" not in capsys.readouterr().out


def test_the_pipeline_of_a_record_is_no_curve_of_the_sinks():
    record = {**train_record(), "microbatches": 8, "schedule": "gpipe", "data_parallel": 1}
    assert not [tag for tag in scalars(record) if "microbatches" in tag or "data_parallel" in tag]


def _timed_records(first, seconds, k, m, bubble, theory):
    """One start's records as the loop writes them: each stage's parts add up to the step, the bubble is their wait."""
    records = []
    for step, t in enumerate(seconds, first):
        record = train_record(step=step, stages=k)
        waits = [bubble * t * (1 + 0.5 * (s - (k - 1) / 2)) for s in range(k)]  # stages wait unevenly, mean bubble*t
        record["time_s"] = {"compute": [t - w - 0.01 for w in waits], "wait": waits, "comm": [0.004] * k,
                            "optimizer": [0.003] * k, "other": [0.003] * k}
        record.update(step_time_s=t, samples_per_s=32 / t, bubble=sum(waits) / k / t, bubble_theory=theory,
                      microbatches=m, schedule="gpipe", data_parallel=1)
        records.append(record)
    records[0]["warmup"] = True
    records[0]["resumed"] = first > 1
    return records


def _row(out, label):
    """The cells of the run table's row of `label`."""
    line = next(line for line in out.splitlines() if line.startswith(f"│ {label} "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def _run_of(folder, *starts):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for records in starts for r in records))
    return folder


# K=2 M=4, steps 1-4, then resumed at K=1 M=2, steps 5-7: every figure of the two cuts apart.
BEFORE = (1, (2.0, 0.5, 0.5, 0.5), 2, 4, 0.3, 0.2)
AFTER = (5, (3.0, 1.0, 2.0), 1, 2, 0.01, 0.0)


def test_a_run_resumed_with_another_pipeline_has_its_row_of_that_pipeline_over_its_own_steps(tmp_path, capsys):
    # The row read "K=1 M=2 gpipe │ 4 │ ... │ bubble 0.149 │ theory 0.100 │ wait 3%": theory neither K=1's nor
    # K=2's, the bubble a plain mean of the steps of both pipelines, the wait weighted by time.
    before, after = _timed_records(*BEFORE), _timed_records(*AFTER)
    for record in before:
        record["mem_peak_bytes"] = [2 << 30] * 2
    run = _run_of(tmp_path / "run", before, after)
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    cells = _row(out, "K=1 M=2 gpipe")
    steady = after[1:]  # K=1's steps after its warm-up
    seconds = sum(r["step_time_s"] for r in steady)
    assert cells[1] == "7 (pipeline changed at 5)"
    assert cells[4] == f"{32 * len(steady) / seconds:.1f}"
    assert cells[5] == f"{sum(r['bubble'] * r['step_time_s'] for r in steady) / seconds:.3f}" == "0.010"
    assert cells[6] == "0.000"  # K=1's theory, not a mean with K=2's 0.2
    assert cells[7] == "1%"
    assert cells[8] == "2.0 GiB"  # the largest peak of every step, whatever pipeline ran it
    assert ("samples/s, bubble and wait: mean over steps 5-7 only, its last pipeline, after the first, which took "
            "3.00 s warming up; each step weighted by its time") in out
    assert "memory: the largest peak of any stage at any step, whatever pipeline ran it" in out
    assert "per stage (mean over the steps after warm-up; K=1 M=2 gpipe: steps 5-7 only, its last pipeline)" in out


def test_the_bubble_and_the_wait_are_weighted_alike_by_step_time(tmp_path, capsys):
    # Steps of uneven length and bubble: the bubble was their plain mean, the wait their time-weighted share.
    records = _timed_records(1, (1.0, 0.2, 2.0, 0.3), 2, 4, 0.3, 0.2)
    for record, bubble in zip(records, (0.5, 0.6, 0.1, 0.5)):
        record["time_s"]["wait"] = [bubble * record["step_time_s"]] * 2
        record["time_s"]["compute"] = [record["step_time_s"] * (1 - bubble) - 0.01] * 2
        record["bubble"] = bubble
    run = _run_of(tmp_path / "run", records)
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    cells = _row(out, "K=2 M=4 gpipe")
    steady = records[1:]
    weighted = sum(r["bubble"] * r["step_time_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
    plain = sum(r["bubble"] for r in steady) / len(steady)
    assert f"{plain:.3f}" != f"{weighted:.3f}"
    assert cells[5] == f"{weighted:.3f}" and cells[7] == f"{weighted:.0%}"  # the same figure, as a share
    assert "; each step weighted by its time" in out and "whatever pipeline" not in out


def test_a_last_pipeline_of_several_starts_or_of_one_step_says_which_steps(tmp_path, capsys, monkeypatch):
    again = _timed_records(8, (2.5, 1.0, 1.0), 1, 2, 0.01, 0.0)  # K=1 resumed again, unchanged
    run = _run_of(tmp_path / "run", _timed_records(*BEFORE), _timed_records(*AFTER), again)
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert _row(out, "K=1 M=2 gpipe")[1] == "10 (pipeline changed at 5)"
    assert ("mean over steps 5-10 only, its last pipeline, after the first of each start (at steps 5 and 8), which "
            "took 3.00 and 2.50 s warming up; each step weighted by its time") in out
    lone = _run_of(tmp_path / "lone", _timed_records(*BEFORE), _timed_records(5, (3.0,), 1, 2, 0.01, 0.0))
    assert cli(["report", str(lone), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert _row(out, "K=1 M=2 gpipe")[1] == "5 (pipeline changed at 5)"
    assert "samples/s, bubble and wait: mean over step 5 only, its last pipeline; each step weighted" in out
    assert "per stage (mean over the training steps; K=1 M=2 gpipe: step 5 only, its last pipeline)" in out
    # Beside other runs, the run changed is named in the words of the run table, as in the per-stage title.
    monkeypatch.chdir(tmp_path)
    plain = _run_of(tmp_path / "plain", _timed_records(*BEFORE))
    assert cli(["report", str(plain), str(run)]) == 0
    out = capsys.readouterr().out
    assert ("samples/s, bubble and wait: mean over the steps after the first of each run and each resume, which warm "
            "up; K=1 M=2 gpipe: steps 5-10 only, its last pipeline; each step weighted by its time") in out
    assert _row(out, "K=2 M=4 gpipe")[1] == "4"
