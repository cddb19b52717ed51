"""A small `gpipe bench` end to end: real ranks, baselines, trace and JSON (properties, not speed)."""

import json
from collections import Counter

import pytest
from rich.console import Console
from torch.distributed.pipelining import schedules

from gpipe_cli.bench import BenchOptions, run, tables
from gpipe_cli.pipeline import schedule as sched
from tests.bench import tiny

REQUIRED = ("partitions", "microbatches", "samples_per_s", "samples_per_s_k1", "normalized", "efficiency", "bubble",
            "bubble_theory", "oversubscribed")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    options = BenchOptions(**tiny.TRANSFORMER, partitions=2, microbatches=4, batch_size=8, steps=2, warmup=1,
                           compare=True, trace=folder / "step.json", json=folder / "bench.json")
    assert run(options) == 0
    return options, json.loads((folder / "bench.json").read_text())


def test_the_json_has_every_figure(bench):
    _, figures = bench
    for key in REQUIRED:
        assert key in figures, key
    assert figures["partitions"] == 2 and figures["microbatches"] == 4
    assert figures["samples_per_s"] > 0 and figures["samples_per_s_k1"] > 0
    assert figures["tokens_per_s"] > 0  # a text model also counts tokens
    assert figures["bubble_theory"] == pytest.approx(1 / 5)
    assert figures["efficiency"] == pytest.approx(figures["normalized"] / figures["ideal"])
    assert figures["ideal"] == pytest.approx(2 * 4 / 5)  # GPipe's K·M/(M+K-1)
    assert isinstance(figures["oversubscribed"], bool)
    assert sum(figures["balance"]) == 6 and len(figures["stages"]) == 2
    assert figures["prediction"]["label"] == "prediction" and figures["prediction"]["samples_per_s"] > 0


def _check_counterpart(options, figures, name, cls_name):
    """torch's counterpart ran with our recomputation, and its ratios are ours over its figures."""
    theirs = figures["compare"][name]
    assert theirs["class"] == cls_name and "skipped" not in theirs
    k = options.partitions
    assert len(theirs["stage_peak_bytes"]) == k == len(figures["stage_peak_bytes"])
    assert min(theirs["stage_peak_bytes"]) > 0 and theirs["samples_per_s"] > 0
    assert all(0 <= idle <= 1 for idle in theirs["stage_idle"])
    assert theirs["throughput_ratio"] == pytest.approx(figures["samples_per_s"] / theirs["samples_per_s"])
    assert theirs["memory_ratio"] == pytest.approx(figures["peak_mem_bytes"] / theirs["peak_mem_bytes"])
    # The same checkpoint mode on both sides, each on its own order: ours recomputes what its lists mark.
    ours = [sched.build(options.schedule, s, k, options.microbatches, options.checkpoint, options.virtual_stages)
            for s in range(k)]
    assert theirs["checkpoint"] == options.checkpoint
    assert theirs["stage_recomputed_ours"] == [len(sched.rematerialised(acts)) for acts in ours]
    forwards = options.microbatches * options.virtual_stages
    assert all(0 <= n <= forwards for n in theirs["stage_recomputed"]) and sum(theirs["stage_recomputed"]) > 0


def test_compare_runs_the_counterpart_with_the_same_recomputation(bench):
    options, figures = bench
    assert set(figures["compare"]) == {"torch-gpipe"}
    _check_counterpart(options, figures, "torch-gpipe", "ScheduleGPipe")
    assert figures["prediction"]["measured_over_predicted"] > 0


def test_a_counterpart_not_measured_is_one_line_in_the_report(bench):
    _, figures = bench
    missing = {"class": "ScheduleX", "skipped": "torch 2.13 has no ScheduleX"}
    console = Console(record=True, width=200)
    tables.show({**figures, "compare": {**figures["compare"], "torch-x": missing}}, console)
    text = console.export_text()
    assert "torch-x: not measured (torch 2.13 has no ScheduleX)" in text
    assert "ScheduleGPipe" in text and "simulator vs measurement (gpipe)" in text
    # The stage table's idle is not 1 - busy / step of the medians beside it: each is its own median.
    assert "each column is its own median over the steps" in text


@pytest.mark.slow
def test_compare_interleaved_against_torchs_interleaved_1f1b(tmp_path):
    options = BenchOptions(**tiny.TRANSFORMER, partitions=2, microbatches=4, batch_size=8, steps=1, warmup=0,
                           schedule="interleaved", virtual_stages=2, compare=True, json=tmp_path / "bench.json")
    assert run(options) == 0
    figures = json.loads(options.json.read_text())
    # The schedule's own ideal: it idles less than GPipe, whose K·M/(M+K-1) judged every schedule.
    assert figures["ideal"] == pytest.approx(2 * (1 - figures["bubble_theory"])) and figures["ideal"] > 2 * 4 / 5
    assert set(figures["compare"]) == {"torch-interleaved"}
    if not hasattr(schedules, "ScheduleInterleaved1F1B"):  # an older torch: a reason, not an error
        assert "skipped" in figures["compare"]["torch-interleaved"]
        return
    _check_counterpart(options, figures, "torch-interleaved", "ScheduleInterleaved1F1B")


def test_the_trace_has_one_event_per_action_of_the_schedule(bench):
    options, figures = bench
    trace = json.loads(options.trace.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    actions = sched.build_all(options.schedule, 2, 4, options.checkpoint)
    expected = Counter((s, a.kind.value, a.microbatch) for s, acts in enumerate(actions) for a in acts)
    assert Counter((e["tid"], e["args"]["action"], e["args"]["microbatch"]) for e in events) == expected
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["name"]
    assert figures["trace"]["events"] == len(events)
    assert options.trace.with_suffix(".png").stat().st_size > 0


def test_simulate_predicts_without_launching_k_ranks(tmp_path):
    out = tmp_path / "sim.json"
    options = BenchOptions(**tiny.TRANSFORMER, microbatches=4, batch_size=8, steps=2, warmup=0, simulate=True,
                           devices=4, json=out)
    assert run(options) == 0
    figures = json.loads(out.read_text())
    assert figures["simulated"] and not figures["measured"] and figures["partitions"] == 4
    assert figures["stages"] == [] and figures["prediction"]["partitions"] == 4
    assert figures["bubble"] == pytest.approx(figures["prediction"]["bubble"])
    # The predicted examples each carry the tokens a measured example did.
    per_example = figures["tokens_per_s_k1"] / figures["samples_per_s_k1"]
    assert figures["tokens_per_s"] == pytest.approx(figures["samples_per_s"] * per_example)


def test_sweep_prints_the_papers_table(tmp_path):
    out = tmp_path / "sweep.json"
    options = BenchOptions(**tiny.TRANSFORMER, sweep=True, batch_size=32, steps=1, warmup=0, json=out)
    assert run(options) == 0
    figures = json.loads(out.read_text())
    cells = {(c["partitions"], c["microbatches"]): c for c in figures["sweep"]}
    assert {m for _, m in cells} == {1, 4, 32}
    assert cells[(2, 1)]["normalized"] == pytest.approx(1.0)
    for cell in cells.values():  # each cell's throughput over the K=2, M=1 one's
        assert cell["normalized"] == pytest.approx(cell["samples_per_s"] / cells[(2, 1)]["samples_per_s"])
    assert cells[(2, 32)]["paper"] == 1.8  # Transformer-48, K=2, M=32 in the paper's Table 2
    assert out.with_suffix(".png").stat().st_size > 0  # the table drawn beside the JSON
