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
