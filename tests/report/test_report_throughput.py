"""`gpipe report`'s throughput is the train summary's: all samples over all seconds after the warm-up step."""

import json

from gpipe_cli.cli import run as cli
from gpipe_cli.report.runs import read_runs, throughput
from gpipe_cli.train.summary import RunSummary
from tests.report.test_report import make_run
from tests.train.test_report import train_record

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
    assert f" {rate.samples_per_s:.1f} " in out and f"samples/s: mean over {rate.over}" in out


def test_a_run_of_one_step_is_the_mean_over_that_step_in_both(tmp_path):
    run = make_run(tmp_path / "run", 2, steps=1)
    record = {**train_record(step=1), "step_time_s": 2.0, "samples_per_s": BATCH / 2.0}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    rate = throughput(read_runs([run])[0])
    assert summary_throughput([record]) == f"{rate.samples_per_s:.1f} samples/s (mean over {rate.over})"
    assert rate.over == "the training steps"
