"""The host-overhead line: the K=1 engine against a plain loop over the same layers (properties, not speed)."""

import json
import re
from dataclasses import replace

import pytest
import torch

from gpipe_cli.bench import BenchOptions, overhead, preview, run, tables
from gpipe_cli.bench.options import overhead_rounds
from gpipe_cli.estimate.measure import build_pipeline
from gpipe_cli.estimate.subject import example_batch, resolve
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from tests.bench import tiny

M = 2
BATCH = 6  # not divisible by 4: the engine's uneven micro-batch sizes on both sides


def _spec(dropout=0.0):
    return resolve(tiny.TRANSFORMER["model"], tiny.sizes(tiny.TRANSFORMER),
                   [*tiny.TRANSFORMER["set"], f"dropout={dropout}"]).build()


@pytest.mark.parametrize("dropout", [0.0, 0.3])  # the plain loop's micro-batches draw the engine's masks
@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_the_plain_loop_leaves_the_engines_gradients(mode, dropout):
    spec = _spec(dropout)
    inputs, targets = example_batch(spec, BATCH, seed=0)
    remat = overhead.remat_microbatches("gpipe", M, mode)
    assert remat == {"never": [], "except_last": [0], "always": [0, 1]}[mode]  # K=1 GPipe: all but the last
    config = PipelineConfig(schedule="gpipe", checkpoint=mode, balance=(len(spec.layers),))
    pipe = build_pipeline(spec, topology.local("cpu"), config, seed=0)
    plain = overhead.PlainLoop(spec, torch.device("cpu"), 0, M, remat)
    ours = pipe.train_step(inputs, targets, microbatches=M, step=0)
    theirs = plain.step(inputs, targets)
    pipe.close()
    assert theirs == pytest.approx(ours.loss, rel=1e-6)
    engine_params, plain_params = pipe.parameters(), plain.params
    assert len(engine_params) == len(plain_params) and engine_params  # tied parameters counted once on both
    for a, b in zip(engine_params, plain_params):
        assert a is not b and a.grad is not None and b.grad is not None
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schedule", ["zero-bubble-v", "v-half"])
def test_a_v_schedule_at_k1_is_measured_in_its_two_chunks(schedule):
    # `gpipe bench --partitions 1 --schedule zero-bubble-v --virtual-stages 2` ended in a traceback: the K=1 engine
    # was built with one chunk, which a V schedule refuses.
    spec = _spec()
    inputs, targets = example_batch(spec, BATCH, seed=0)
    half = len(spec.layers) // 2
    h = overhead.compare(spec, topology.local("cpu"), inputs, targets, M, schedule, "except_last", seed=0, steps=2,
                         warmup=0, balance=(half, len(spec.layers) - half))
    assert h["rematerialised"] == [0, 1]  # every micro-batch in the V's first chunk, none in its last
    assert h["plain_loss"] == pytest.approx(h["engine_loss"], rel=1e-6)
    assert h["gradient_max_relative_difference"] < tables.GRADIENTS_AGREE


def test_the_measurement_at_k1_two_microbatches():
    spec = _spec()
    inputs, targets = example_batch(spec, BATCH, seed=0)
    h = overhead.compare(spec, topology.local("cpu"), inputs, targets, M, "gpipe", "except_last", seed=0, steps=4,
                         warmup=1)
    assert h["partitions"] == 1 and h["microbatches"] == M and h["rematerialised"] == [0]
    assert h["rounds"] == 2 and h["steps_per_round"] == 2
    assert len(h["engine_step_times"]) == len(h["plain_step_times"]) == 4
    assert h["engine_step_s"] > 0 and h["plain_step_s"] > 0
    assert h["engine_step_s"] == min(h["engine_step_times"]) and h["plain_step_s"] == min(h["plain_step_times"])
    assert h["overhead_step_s"] == pytest.approx(h["engine_step_s"] - h["plain_step_s"])
    assert h["overhead_per_microbatch_s"] == pytest.approx(h["overhead_step_s"] / M)
    assert h["plain_loss"] == pytest.approx(h["engine_loss"], rel=1e-6)
    assert h["gradient_max_relative_difference"] < tables.GRADIENTS_AGREE
    assert h["threads"] == torch.get_num_threads() and not h["optimizer_step"]

    text = tables.host_overhead({"host_overhead": h})
    found = re.fullmatch(r"host overhead \(K=1, M=2\): engine (\S+) ms/step, plain loop (\S+) ms/step \((\S+)x\): "
                         r"the engine (adds|saves) (\S+) ms a step, (\S+) ms per micro-batch "
                         r"\(best of 4 steps each in 2 alternating rounds, no optimizer step, \d+ threads?\)", text)
    assert found, text
    engine, plain, ratio = map(float, found.groups()[:3])
    sign = 1 if found[4] == "adds" else -1
    step, per = (sign * float(g) for g in found.groups()[4:])
    assert engine > 0 and plain > 0
    # Each time is printed to 0.1 ms: the ratio of the printed times is off by up to that rounding's share.
    assert ratio == pytest.approx(plain / engine, abs=0.01 + ratio * (0.05 / engine + 0.05 / plain))
    assert step == pytest.approx(engine - plain, abs=0.11)  # each printed to 0.1 ms
    assert per == pytest.approx(step / M, abs=0.06)


def test_gradients_that_differ_are_said_in_the_line():
    h = {"partitions": 1, "microbatches": 4, "threads": 1, "engine_step_s": 0.02, "plain_step_s": 0.01,
         "plain_over_engine": 0.5, "overhead_step_s": 0.01, "overhead_per_microbatch_s": 0.0025, "rounds": 2,
         "steps_per_round": 1, "gradient_max_relative_difference": 0.3}
    text = tables.host_overhead({"host_overhead": h})
    assert "the engine adds 10.0 ms a step, 2.50 ms per micro-batch" in text and "should agree" in text
    assert "agree" not in tables.host_overhead({"host_overhead": {**h, "gradient_max_relative_difference": 0.0}})
    faster = {**h, "plain_over_engine": 2.0, "overhead_step_s": -0.01, "overhead_per_microbatch_s": -0.0025}
    assert "(2.00x): the engine saves 10.0 ms a step, 2.50 ms per micro-batch" in tables.host_overhead(
        {"host_overhead": faster})


def test_k1_alone_is_measured_once():
    assert BenchOptions(partitions=1).measures_once
    assert not BenchOptions(partitions=2).measures_once
    assert not BenchOptions(partitions=1, virtual_stages=2).measures_once  # one rank's two chunks: another run
    assert not BenchOptions(partitions=1, sweep=True).measures_once
    assert not BenchOptions(partitions=1, simulate=True, devices=4).measures_once


def test_it_is_measured_when_the_bench_is_of_k1_and_said_to_be_otherwise():
    assert BenchOptions(partitions=1).measures_host_overhead
    assert BenchOptions(partitions=2, simulate=True, devices=1).measures_host_overhead
    assert not BenchOptions(partitions=2).measures_host_overhead
    assert not BenchOptions(partitions=1, sweep=True).measures_host_overhead
    assert "measured at K=1 only" in tables.host_overhead({"host_overhead": None})
    assert overhead_rounds(60) == (10, 6) and overhead_rounds(1) == (1, 1)
    assert overhead_rounds(5) == (2, 3)


def test_bench_at_k1_prints_the_line_and_writes_the_figures(tmp_path, capsys):
    options = BenchOptions(**tiny.TRANSFORMER, partitions=1, microbatches=M, batch_size=BATCH, steps=2, warmup=0,
                           checkpoint="never", json=tmp_path / "bench.json")
    assert run(options) == 0
    printed = capsys.readouterr().out
    figures = json.loads((tmp_path / "bench.json").read_text())
    h = figures["host_overhead"]
    assert h["microbatches"] == M and h["rematerialised"] == [] and h["engine_step_s"] > 0
    assert "host overhead (K=1, M=2): engine" in printed
    assert "the engine against a plain loop at K=1" in printed  # the plan says it will run
    assert figures["load"]["host_overhead"] == h["load"]
    # K=1 is the run benchmarked: measured once, so its figures are the run's and it is one row.
    assert "measuring K=1 (" in printed and "measuring K=1 (balance" not in printed
    assert figures["samples_per_s"] == figures["samples_per_s_k1"] and figures["efficiency"] == 1.0
    assert figures["step_times"] == figures["step_times_k1"] and figures["load"]["k"] == {}
    assert sum(line.startswith("│ K=1 ") for line in printed.splitlines()) == 1
    assert preview.runs(options, 10) == [(1, M)] and preview.runs(replace(options, virtual_stages=2), 10) == [
        (1, M), (1, M)]


def test_a_k1_run_of_two_chunks_keeps_its_own_row_beside_the_one_chunk_k1():
    # --partitions 1 --virtual-stages 2 measures two runs: only a run measured once is one row.
    from rich.console import Console

    figures = {"steps": 2, "warmup": 0, "partitions": 1, "simulated": False, "samples_per_s_k1": 10.0,
               "tokens_per_s_k1": None, "step_time_k1_s": 0.1, "samples_per_s": 12.0, "tokens_per_s": None,
               "step_time_s": 0.08}
    for once, rows in ((False, 2), (True, 1)):
        console = Console(width=120, record=True)
        console.print(tables._throughput({**figures, "measured_once": once}))
        assert console.export_text().count("│ K=1 ") == rows


def test_the_plain_loop_rematerialises_as_the_engine_does():
    # Per layer, torch's checkpoint was slower than the engine's remat, and the line said the engine saved time.
    spec = _spec()
    inputs, targets = example_batch(spec, BATCH, seed=0)
    plain = overhead.PlainLoop(spec, torch.device("cpu"), 0, M, overhead.remat_microbatches("gpipe", M, "except_last"))
    seen: list[bool] = []
    first = next(iter(plain.module))
    first.register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    plain.step(inputs, targets)
    assert seen == [False, True, True]  # micro-batch 0 without gradients, then again with them; 1 (the last) once
