"""`gpipe report`'s throughput is the train summary's: all samples over all seconds after the warm-up step (of each
start, for a resumed run)."""

import json
import re

import pytest

from gpipe_cli.cli import run as cli
from gpipe_cli.report.runs import read_runs, segment_throughputs, throughput, time_breakdown, timed_mean
from gpipe_cli.train.summary import RunSummary
from tests.report.test_report import make_run
from tests.train.test_view import train_record

BATCH = 32
SECONDS = (2.0, 0.1, 0.3, 0.2, 0.9)  # uneven steps: the mean of per-step rates would differ


def summary_throughput(records):
    summary = RunSummary(total_steps=len(records), started=0.0)
    for record in records:
        summary.add(record, examples=BATCH, units=None)
    line = next(line for line in summary.lines(now=10.0, checkpoint=None, run_dir="r", text=False)
                if "throughput:" in line)
    return line.split("throughput:", 1)[1].strip()


def test_the_report_and_the_train_summary_give_the_same_throughput(tmp_path, capsys):
    run = make_run(tmp_path / "run", 2, steps=len(SECONDS))
    records = []
    for step, seconds in enumerate(SECONDS, 1):  # as the loop writes them: samples_per_s is the batch over the step
        records.append({**train_record(step=step), "step_time_s": seconds, "samples_per_s": BATCH / seconds})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    said = summary_throughput(records)  # "142.2 samples/s (mean over the steps after the first, which took ...)"
    (report_run,) = read_runs([run])
    rate = throughput(report_run)
    assert said == f"{rate.samples_per_s:.1f} samples/s (mean over {rate.over})"
    per_step = sum(BATCH / s for s in SECONDS[1:]) / (len(SECONDS) - 1)
    assert f"{per_step:.1f}" != f"{rate.samples_per_s:.1f}"  # the figure the report printed before
    assert cli(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert f" {rate.samples_per_s:.1f} " in out and f"samples/s, bubble and wait: mean over {rate.over}" in out


def test_a_run_of_one_step_is_the_mean_over_that_step_in_both(tmp_path):
    run = make_run(tmp_path / "run", 2, steps=1)
    record = {**train_record(step=1), "step_time_s": 2.0, "samples_per_s": BATCH / 2.0}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    rate = throughput(read_runs([run])[0])
    assert summary_throughput([record]) == f"{rate.samples_per_s:.1f} samples/s (mean over {rate.over})"
    assert rate.over == "the training steps"


def segment_records(first_step, seconds, resumed):
    """The train records of one `gpipe train` of a run, the first marked when it came after a resume."""
    records = [{**train_record(step=step), "step_time_s": s, "samples_per_s": BATCH / s}
               for step, s in enumerate(seconds, first_step)]
    if resumed:
        records[0]["resumed"] = True
    return records


def summary_rate(records):
    """The samples/s figure of the summary `gpipe train` prints after these records."""
    return summary_throughput(records).split(" samples/s", 1)[0]


RESUMED = ((1, (2.0, 0.1, 0.3, 0.2)), (5, (1.5, 0.4, 0.2, 0.6)), (9, (0.8, 0.3)))  # first step, step seconds


def test_a_resumed_run_gives_each_start_as_its_summary_did_and_the_run_over_every_measured_step(tmp_path, capsys):
    run = make_run(tmp_path / "run", 2)
    starts = [segment_records(first, seconds, resumed=first > 1) for first, seconds in RESUMED]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for records in starts for r in records))
    (report_run,) = read_runs([run])
    each = segment_throughputs(report_run)
    assert [rate.steps for rate in each] == ["1-4", "5-8", "9-10"]
    assert [f"{rate.samples_per_s:.1f}" for rate in each] == [summary_rate(records) for records in starts]
    # The run: every step after the first of each start; the warm-ups, and the time between starts, never count.
    measured = [s for _, seconds in RESUMED for s in seconds[1:]]
    rate = throughput(report_run)
    assert rate.samples_per_s == pytest.approx(BATCH * len(measured) / sum(measured))
    assert rate.over == ("the steps after the first of the run and of each resume (at steps 5 and 9), "
                         "which took 2.00, 1.50 and 0.80 s warming up")
    every_but_first = [s for _, seconds in RESUMED for s in seconds][1:]  # what the report gave before
    assert f"{BATCH * len(every_but_first) / sum(every_but_first):.1f}" != f"{rate.samples_per_s:.1f}"
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert f" {rate.samples_per_s:.1f} " in out and f"samples/s, bubble and wait: mean over {rate.over}" in out
    assert "per start of a resumed run" in out
    for shown, records in zip(each, starts):
        assert re.search(rf"{shown.steps} +│ +{summary_rate(records)} +│ +{shown.warmup_s:.2f}", out)


def test_a_start_whose_later_steps_a_resume_set_aside_is_marked_as_not_its_summary(tmp_path, capsys):
    # The second start ran on past step 8; a resume from step 8's checkpoint set its later steps aside.
    run = make_run(tmp_path / "run", 2)
    (run / "checkpoints" / "superseded-20261207-031500-at-step-8" / "step-00000010").mkdir(parents=True)
    starts = [segment_records(first, seconds, resumed=first > 1) for first, seconds in RESUMED]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for records in starts for r in records))
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"5-8 \+ +│", out) and not re.search(r"(1-4|9-10) \+", out)
    assert "a start whose later steps a resume set aside (+): over its steps kept, not as its summary gave" in out


def test_the_summary_after_a_resume_says_its_figures_are_since_the_resume():
    summary = RunSummary(total_steps=8, started=0.0)
    for record in segment_records(5, (1.5, 0.4, 0.2, 0.6), resumed=True):
        summary.add(record, examples=BATCH, units=None)
    lines = summary.lines(now=10.0, checkpoint=None, run_dir="r", text=False)
    assert lines[0] == "summary: steps 5-8 of 8, since the resume, in 10.0 s wall time"
    assert summary_throughput(segment_records(5, (1.5, 0.4, 0.2, 0.6), resumed=True)).endswith(
        "warming up; gpipe report r gives the whole run's)")


def test_a_run_that_was_never_resumed_shows_no_table_of_starts(tmp_path, capsys):
    run = make_run(tmp_path / "run", 2)
    assert len(segment_throughputs(read_runs([run])[0])) == 1
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    assert "per start" not in capsys.readouterr().out


def test_starts_of_one_step_each_are_the_mean_over_those_steps(tmp_path):
    run = make_run(tmp_path / "run", 2)
    starts = [segment_records(first, (s,), resumed=first > 1) for first, s in ((1, 2.0), (2, 1.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for records in starts for r in records))
    rate = throughput(read_runs([run])[0])
    assert rate.samples_per_s == pytest.approx(2 * BATCH / 3.0) and rate.over == "the training steps"


def test_the_report_leaves_out_profiled_steps_as_the_train_summary_does(tmp_path, capsys):
    run = make_run(tmp_path / "run", 2)
    records = segment_records(1, (2.0, 0.1, 1.9, 0.3, 0.2, 0.9), resumed=False)
    for record in records[2:4]:
        record["profiled"] = True
        record["bubble"] = 0.9
        record["time_s"]["other"] = [record["step_time_s"]] * 2  # the trace's writing
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (report_run,) = read_runs([run])
    rate = throughput(report_run)
    kept = (0.1, 0.2, 0.9)
    assert rate.samples_per_s == pytest.approx(BATCH * len(kept) / sum(kept))
    assert summary_throughput(records) == f"{rate.samples_per_s:.1f} samples/s (mean over {rate.over})"
    assert rate.over.endswith(", and not the 2 profiled (steps 3-4)")
    assert timed_mean(report_run, "bubble") == pytest.approx(0.2)
    assert time_breakdown(report_run)["other"] == pytest.approx(
        [sum(r["time_s"]["other"][s] for r in records if r["step"] in (2, 5, 6)) / 3 for s in range(2)])
    assert cli(["report", str(run), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert f"mean over {rate.over}" in out and "not the 2 profiled (steps 3-4)" in out.split("per stage", 1)[1]


def test_a_course_a_resume_set_aside_counts_its_first_step_unless_it_warmed_up_there(tmp_path, capsys):
    # A run trained steps 1-10 in one start; a resume from step 6 set steps 7-10 aside. Step 7 was taken for a
    # warm-up and left out of the course's mean, and the words said it warmed up.
    run = make_run(tmp_path / "run", 2, steps=6)
    course = run / "checkpoints" / "superseded-20261207-031500-at-step-6"
    course.mkdir(parents=True)
    seconds = (0.3, 0.2, 0.9, 0.4)
    records = segment_records(7, seconds, resumed=False)
    (course / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rate = throughput(read_runs([course])[0])
    assert rate.samples_per_s == pytest.approx(BATCH * 4 / sum(seconds)) and rate.over == "the training steps"
    # Resumed within the course at step 9: that step warmed up, the course's first did not.
    records = segment_records(7, seconds[:2], resumed=False) + segment_records(9, seconds[2:], resumed=True)
    (course / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rate = throughput(read_runs([course])[0])
    assert rate.samples_per_s == pytest.approx(BATCH * 3 / (0.3 + 0.2 + 0.4))
    assert rate.over == "the steps after the first of the resume (at step 9), which took 0.90 s warming up"
    assert cli(["report", str(course), "--output", str(tmp_path / "page.png")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"samples/s, bubble and wait: mean over {rate.over}" in out
