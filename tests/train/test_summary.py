"""The end-of-run summary."""

import pytest

from gpipe_cli.train.summary import RunSummary
from tests.train.test_view import train_record


def run(skipped_steps=(), evals=()):
    summary = RunSummary(total_steps=6, started=100.0)
    for step in range(1, 5):
        record = train_record(step=step)
        record["bubble"] = 0.1 * step
        if step in skipped_steps:
            record["skipped"] = True
        summary.add(record, examples=32, units=300)
    for step, loss in evals:
        summary.add({"kind": "eval", "step": step, "loss": loss, "accuracy": 1 / loss}, 0, None)
    return summary


def field(lines, name):
    return next(line.split(":", 1)[1].strip() for line in lines if line.strip().startswith(name + ":"))


def test_the_summary_names_every_fact_of_the_run():
    lines = run(skipped_steps=(2,), evals=[(2, 3.0), (4, 1.5), (6, 2.0)]).lines(
        now=130.0, checkpoint="run/checkpoints/step-00000004", run_dir="run", text=True, ended="stopped by SIGINT")
    assert lines[0].startswith("summary: 4 of 6 steps in 30.0 s wall time") and "stopped by SIGINT" in lines[0]
    seconds = 3 * train_record()["step_time_s"]  # the first step warms up and is left out
    assert field(lines, "throughput").startswith(f"{3 * 32 / seconds:.1f} samples/s, {3 * 300 / seconds:.0f} tokens/s")
    assert "after the first" in field(lines, "throughput")
    assert field(lines, "bubble").startswith(f"{(0.2 + 0.3 + 0.4) / 3:.3f} measured")  # the warm-up left out too
    assert "0.200 in theory" in field(lines, "bubble")
    assert field(lines, "best eval").startswith("step 4: loss 1.5")  # the lowest loss, not the last eval
    assert field(lines, "final eval").startswith("step 6: loss 2")  # the run's end: printed here only
    assert field(lines, "skipped steps") == "1"
    assert field(lines, "checkpoint") == "run/checkpoints/step-00000004"
    assert field(lines, "run directory") == "run"
    shares = [int(token.rstrip("%,")) for token in field(lines, "step time").split() if token.rstrip(",").endswith("%")]
    assert len(shares) == 5 and sum(shares) == pytest.approx(100, abs=5)


def test_a_run_without_evals_or_checkpoint_says_so():
    lines = run().lines(now=101.0, checkpoint=None, run_dir="run", text=False)
    assert field(lines, "best eval") == "none" and field(lines, "checkpoint") == "none written"
    assert "tokens/s" not in field(lines, "throughput")


def test_the_warm_up_step_is_left_out_of_the_throughput_but_a_lone_step_counts():
    summary = RunSummary(total_steps=3, started=0.0)
    for seconds in (2.0, 0.5, 0.5):
        summary.add({**train_record(), "step_time_s": seconds}, examples=10, units=None)
    assert field(summary.lines(now=5.0, checkpoint=None, run_dir="r", text=False), "throughput").startswith(
        "20.0 samples/s (mean over the steps after the first, which took 2.00 s warming up)")
    lone = RunSummary(total_steps=1, started=0.0)
    lone.add({**train_record(), "step_time_s": 2.0}, examples=10, units=None)
    assert field(lone.lines(now=5.0, checkpoint=None, run_dir="r", text=False), "throughput").startswith(
        "5.0 samples/s (mean over the training steps)")


def test_a_marked_warm_up_step_is_left_out_of_the_throughput_bubble_and_shares():
    summary = RunSummary(total_steps=8, started=0.0)
    for step, seconds, bubble in ((5, 3.0, 0.9), (6, 0.5, 0.2), (7, 0.5, 0.3)):
        record = {**train_record(step=step), "step_time_s": seconds, "bubble": bubble}
        if step == 5:
            record.update(warmup=True, resumed=True)
        summary.add(record, examples=10, units=None)
    lines = summary.lines(now=5.0, checkpoint=None, run_dir="r", text=False)
    assert field(lines, "throughput").startswith("20.0 samples/s (mean over the steps after the first, which took "
                                                 "3.00 s warming up; gpipe report r gives the whole run's)")
    spaced = field(summary.lines(now=5.0, checkpoint=None, run_dir="out dir/r", text=False), "throughput")
    assert spaced.endswith("; gpipe report 'out dir/r' gives the whole run's)")  # a command to copy, quoted
    assert field(lines, "bubble").startswith("0.250 measured")


def test_a_final_eval_that_is_the_best_is_given_once():
    lines = run(evals=[(2, 3.0), (6, 1.0)]).lines(now=130.0, checkpoint=None, run_dir="run", text=False)
    evals = [line for line in lines if "eval" in line]
    assert len(evals) == 1 and evals[0].startswith("  best eval: step 6: loss 1")


@pytest.mark.parametrize("width", [80, 120])
def test_the_summary_on_a_terminal_wraps_at_spaces(width):
    from gpipe_cli.console import fit
    from tests.widths import problems

    lines = run(evals=[(2, 3.0), (6, 2.0)]).lines(now=130.0, checkpoint="outputs/tiny/20260101-000000/checkpoints/"
                                                   "step-00000006", run_dir="outputs/tiny/20260101-000000", text=True)
    shown = "\n".join(fit(line, width) for line in lines)
    assert not problems(shown, width, "\n".join(lines)), shown


def test_the_bubbles_theory_is_named_for_the_runs_schedule():
    for formula in ("(K-1)/(M+K-1)", "of zero-bubble-v"):
        summary = RunSummary(3, 0.0, formula=formula)
        for step in (1, 2, 3):
            summary.add(train_record(step=step), 4, None)
        bubble = [line for line in summary.lines(10.0, None, "run", text=False) if "bubble:" in line]
        assert bubble and bubble[0].endswith(f"in theory ({formula})"), bubble


def test_the_bubble_is_weighted_by_step_time_as_gpipe_report_weights_it():
    summary = RunSummary(total_steps=3, started=0.0)
    for step, seconds, bubble in ((1, 9.0, 0.9), (2, 3.0, 0.1), (3, 1.0, 0.5)):
        summary.add({**train_record(step=step), "step_time_s": seconds, "bubble": bubble}, examples=8, units=None)
    lines = summary.lines(20.0, None, "run", text=False)
    assert field(lines, "bubble").startswith(f"{(3.0 * 0.1 + 1.0 * 0.5) / 4.0:.3f} measured")  # not 0.300


def test_profiled_steps_are_left_out_of_the_means_and_named():
    summary = RunSummary(total_steps=6, started=0.0)
    for step, seconds in enumerate((2.0, 0.5, 1.9, 3.0, 0.5, 0.5), 1):
        record = {**train_record(step=step), "step_time_s": seconds, "bubble": 0.9 if step in (3, 4) else 0.1}
        if step in (3, 4):
            record["profiled"] = True
        summary.add(record, examples=10, units=None)
    lines = summary.lines(now=10.0, checkpoint=None, run_dir="r", text=False)
    assert field(lines, "throughput") == ("20.0 samples/s (mean over the steps after the first, which took 2.00 s "
                                          "warming up, and not the 2 profiled (steps 3-4))")
    assert field(lines, "bubble").startswith("0.100 measured")
    assert lines[0].startswith("summary: 6 of 6 steps"), "profiled steps are steps of the run all the same"


def test_profiled_steps_alone_after_the_warm_up_are_the_mean_and_not_said_left_out():
    summary = RunSummary(total_steps=3, started=0.0)
    for step, seconds in enumerate((2.0, 0.5, 0.5), 1):
        summary.add({**train_record(step=step), "step_time_s": seconds, "profiled": True}, examples=10, units=None)
    throughput = field(summary.lines(now=5.0, checkpoint=None, run_dir="r", text=False), "throughput")
    assert throughput == "20.0 samples/s (mean over the steps after the first, which took 2.00 s warming up)"


def test_an_accuracy_reads_to_four_places_even_when_whole():
    from gpipe_cli.train.summary import eval_figures

    assert eval_figures({"kind": "eval", "step": 2, "loss": 0.5, "accuracy": 1.0}) == "loss 0.5, accuracy 1.0000"
    assert eval_figures({"kind": "eval", "step": 2, "loss": 0.5, "unigram_perplexity": 602.4}) == (
        "loss 0.5, unigram perplexity 602.4")  # in words, as the other figures are


def test_a_resumed_runs_best_eval_counts_its_evals_before_the_resume(tmp_path):
    # Resumed at step 200, a run's summary named its step-204 eval the best, though step 200's was better.
    import json

    metrics = tmp_path / "metrics.jsonl"
    earlier = [{"kind": "eval", "step": 2, "loss": 3.0}, {"kind": "eval", "step": 4, "loss": 1.0},
               {"kind": "eval", "step": 5, "loss": 0.5}]  # after the resume's step: another course's, not this one's
    metrics.write_text("".join(json.dumps(record) + "\n" for record in earlier) + "not json\n")
    summary = RunSummary(total_steps=6, started=100.0)
    summary.take_earlier(metrics, 4)
    summary.add({"kind": "eval", "step": 6, "loss": 2.0}, 0, None)
    lines = summary.lines(now=130.0, checkpoint=None, run_dir="run", text=False)
    assert field(lines, "best eval").startswith("step 4: loss 1")
    assert field(lines, "final eval").startswith("step 6: loss 2")
    fresh = RunSummary(total_steps=6, started=100.0)
    fresh.take_earlier(metrics, 0)  # a run from step 0 has no earlier evals, whatever the folder holds
    assert fresh.best_eval is None


def test_the_step_time_shares_are_the_mean_over_stages():
    # train_record's stage i spends 10 (i + 1) (k + 1) ms of its 500 ms on part k: the mean of the two stages' shares,
    # not the slowest stage's (3, 7, 10, 13, 67).
    lines = run().lines(now=130.0, checkpoint=None, run_dir="run", text=True)
    shares = [int(token.rstrip("%,")) for token in field(lines, "step time").split() if token.rstrip(",").endswith("%")]
    assert shares == [3, 6, 9, 12, 70]


def test_a_resume_on_another_pipeline_points_to_the_report_for_each_start_s_throughput(tmp_path):
    # Resumed at M=4 after steps at M=2, the summary promised a whole-run figure the report does not give.
    import json

    metrics = tmp_path / "metrics.jsonl"
    before = {**train_record(step=2), "microbatches": 2, "schedule": "gpipe", "data_parallel": 1}
    metrics.write_text(json.dumps(before) + "\n")
    said = {}
    for microbatches in (2, 4):
        summary = RunSummary(total_steps=4, started=0.0)
        summary.take_earlier(metrics, 2)
        for step in (3, 4):
            summary.add({**before, "step": step, "microbatches": microbatches, "resumed": True}, examples=10,
                        units=None)
        said[microbatches] = field(summary.lines(now=5.0, checkpoint=None, run_dir="run", text=False), "throughput")
    assert said[2].endswith("; gpipe report run gives the whole run's)")
    assert said[4].endswith("; gpipe report run gives each start's)")
    # A start at M=4 before the last one at M=2: the change lies two starts back, and counts all the same.
    metrics.write_text(json.dumps({**before, "step": 1, "microbatches": 4}) + "\n" + json.dumps(before) + "\n")
    summary = RunSummary(total_steps=4, started=0.0)
    summary.take_earlier(metrics, 2)
    for step in (3, 4):
        summary.add({**before, "step": step, "resumed": True}, examples=10, units=None)
    assert field(summary.lines(now=5.0, checkpoint=None, run_dir="run", text=False), "throughput").endswith(
        "gives each start's)")


def test_a_first_evaluation_that_is_not_finite_is_never_the_best():
    summary = run(evals=[(2, float("nan")), (4, 2.0)])
    assert field(summary.lines(110.0, None, "run", text=False), "best eval").startswith("step 4: loss 2")


def test_a_run_stopped_before_its_end_has_no_final_eval_line():
    # Its last evaluation is a mid-run one, not the final evaluation of the trained model (total_steps 6).
    lines = run(evals=[(2, 1.0), (4, 3.0)]).lines(110.0, None, "run", text=False)
    assert not any(line.strip().startswith("final eval") for line in lines)
    assert field(lines, "best eval").startswith("step 2: loss 1")
