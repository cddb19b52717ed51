"""The GPU acceptance's checks, proven on the CPU: the same runs and comparisons with device "cpu",
the checks failing where they must, and the CUDA-only branches of resuming and `train.device`."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from gpipe_cli.cli import app
from gpipe_cli.estimate.measure import StageFigures
from gpipe_cli.estimate.subject import resolve
from gpipe_cli.models.describe import count_parameters
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.profile.options import ProfileOptions
from gpipe_cli.profile.runner import measure
from gpipe_cli.train import checkpoint
from gpipe_cli.train.resume import Checkpointer
from tests.bench.tiny import TRANSFORMER, sizes
from tests.gpu import runs
from tests.gpu.runs import PRECISION_RECIPE, MiB
from tests.train.recipes import write

GiB = 1024 * MiB


@pytest.mark.slow
def test_precision_and_resume_checks_pass_on_the_cpu(tmp_path: Path) -> None:
    # The checks are what is tested here: the runs start as ranks do, without the launcher (tests/gpu uses it).
    reference = runs.train(tmp_path / "fp32", PRECISION_RECIPE, "cpu", as_ranks=True)
    half = runs.train(tmp_path / "fp16", PRECISION_RECIPE, "cpu", "train.precision=fp16", as_ranks=True)
    runs.check_precision(half, reference, "fp16")
    runs.check_precision(reference, reference, "fp32")
    resumed = runs.resume_on(reference, PRECISION_RECIPE, tmp_path / "resumed", "cpu", keep_step=2, as_ranks=True)
    runs.check_resumed(resumed, reference, runs.TOLERANCE["fp32"])
    with pytest.raises(AssertionError, match="fp32: loss scale 65536"):  # the fp16 run is told apart
        runs.check_precision(half, reference, "fp32")


def test_loss_comparison_fails_beyond_its_tolerance() -> None:
    expected = {1: 6.0, 2: 5.5}
    runs.assert_close({1: 6.0 * (1 + 9e-4), 2: 5.5}, expected, 1e-3, "loss")
    with pytest.raises(AssertionError, match=r"step 2 .*\(relative gap"):
        runs.assert_close({1: 6.0, 2: 5.5 * (1 + 2e-3)}, expected, 1e-3, "loss")
    with pytest.raises(AssertionError, match="steps"):
        runs.assert_close({1: 6.0}, expected, 1e-3, "loss")


def stage(accounted: int, allocator: int) -> dict[str, Any]:
    return asdict(StageFigures(stage=0, layers=3, busy_s=1.0, step_s=1.0, bubble=0.0, activation_peak_bytes=accounted,
                               rss_peak_bytes=0, cuda_peak_bytes=allocator))


def test_peak_check_accepts_what_an_allocator_can_hold_and_nothing_else() -> None:
    params = [100 * MiB]
    runs.check_stage_peaks([stage(GiB, GiB + 300 * MiB)], params, "cuda")
    runs.check_stage_peaks([stage(GiB, 0)], params, "cpu")
    for bad, device in [(stage(GiB, GiB // 2), "cuda"),  # the allocator holds less than was accounted
                        (stage(GiB, 3 * GiB), "cuda"),    # far more than activations, weights and gradients
                        (stage(0, GiB), "cuda"),          # nothing accounted
                        (stage(GiB, GiB), "cpu")]:        # a CUDA figure off CUDA
        with pytest.raises(AssertionError):
            runs.check_stage_peaks([bad], params, device)


def test_stage_parameter_bytes_follow_the_bench_balance() -> None:
    subject = resolve(TRANSFORMER["model"], sizes(TRANSFORMER), TRANSFORMER["set"])
    per_stage = runs.stage_param_bytes({"model": subject.to_json(), "balance": [2, 4]})
    assert len(per_stage) == 2 and all(b > 0 for b in per_stage)
    assert sum(per_stage) == 4 * count_parameters(subject.build())


def test_profile_check_passes_on_the_cpu_against_itself() -> None:
    options = ProfileOptions(model=TRANSFORMER["model"], set=TRANSFORMER["set"], partitions=[2], microbatches=2,
                             **{**sizes(TRANSFORMER), "layers": 2})
    figures = json.loads(json.dumps(measure(options, Console(quiet=True))))  # what --json writes
    runs.check_profile(figures, figures, "cpu")
    with pytest.raises(AssertionError):  # a CPU profile is not taken for a CUDA one
        runs.check_profile(figures, figures, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_device_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train", str(write(tmp_path, PRECISION_RECIPE)), "--output-dir", str(out),
                                      "--set", "train.device=cuda"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]  # stdout may say what was starting
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "train.device: cuda needs a CUDA GPU" in lines[0] and not out.exists()


def _trained_stage() -> tuple[Pipeline, torch.optim.Optimizer]:
    factories = [lambda: nn.Linear(8, 16), nn.Tanh, lambda: nn.Linear(16, 4)]
    pipe = Pipeline(build_layers(factories, range(3), 0), topology.local(), PipelineConfig(balance=(3,)),
                    nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    pipe.train_step(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g), microbatches=2, step=0)
    optimizer.step()
    return pipe, optimizer


def _with_cuda_rng(original: Any) -> Any:
    """Checkpointer._extra as a rank on a CUDA device builds it: the RNG states include the GPU's."""
    def extra(self: Checkpointer, step: int, same_layout: bool) -> dict[str, Any]:
        out = original(self, step, same_layout)
        if same_layout:
            out[f"rng.rank{self.layout.rank}"]["cuda"] = torch.arange(16, dtype=torch.uint8)
        return out
    return extra


@pytest.mark.parametrize("written_on, resumed_on", [("cpu", "cuda"), ("cuda", "cpu")])
def test_checkpoints_resume_across_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_on: str,
                                           resumed_on: str) -> None:
    original = Checkpointer._extra
    plan = SimpleNamespace(balance=[3])
    pipe, optimizer = _trained_stage()
    if written_on == "cuda":
        monkeypatch.setattr(Checkpointer, "_extra", _with_cuda_rng(original))
    Checkpointer(pipe, optimizer, None, pipe.topology, plan, tmp_path, 2).save(1, epoch=1)  # type: ignore[arg-type]
    monkeypatch.setattr(Checkpointer, "_extra", _with_cuda_rng(original) if resumed_on == "cuda" else original)
    restored: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: restored.append(state))
    fresh, fresh_optimizer = _trained_stage()
    for p in fresh.parameters():
        nn.init.zeros_(p)
    found, _ = checkpoint.newest_whole(tmp_path)
    assert found is not None
    step = Checkpointer(fresh, fresh_optimizer, None, fresh.topology, plan, tmp_path, 2).restore(found)  # type: ignore[arg-type]
    assert step == 1 and restored == []  # no GPU state was saved, or none is wanted: nothing to restore
    for a, b in zip(fresh.parameters(), pipe.parameters()):
        assert torch.equal(a, b)


def _script(name: str) -> Any:
    """A module of scripts/ (they are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def test_figures_collects_what_the_acceptance_wrote_and_names_what_is_missing(tmp_path: Path) -> None:
    figures_module = _script("gpu_figures")
    raw = tmp_path / "work"
    raw.mkdir()
    rows = [{"scenario": "naive-1", "partitions": 1, "model": "(18, 208)", "params": 82, "device_peak_bytes": 7.0},
            {"scenario": "pipeline-1", "partitions": 1, "model": "(18, 416)", "params": 318, "device_peak_bytes": 7.5}]
    (raw / "table1-amoebanet.json").write_text(json.dumps(
        {"family": "AmoebaNet-D (L, D)", "kind": "amoebanet", "budget_bytes": 8, "batch_size": 128,
         "optimizer": "rmsprop", "method": "accounting", "rows": rows}))
    (raw / "broken.json").write_text("{")
    (tmp_path / "junit.xml").write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
                                        '<testcase classname="t" name="a"><failure/></testcase></testsuite>'
                                        '</testsuites>')
    (tmp_path / "steps.jsonl").write_text(
        '{"step": "table1-amoebanet", "status": "passed", "exit_code": 0, "seconds": 9.0, "bound_s": 25}\n'
        '{"step": "multigpu", "status": "skipped", "exit_code": 0, "seconds": 0.0, "bound_s": 150, '
        '"why": "needs two GPUs, this machine has 1"}\n')
    assert figures_module.main([str(tmp_path), "--raw", str(raw), "--merge-only"]) == 0
    assert not (tmp_path / "figures.json").exists()
    merged = json.loads((tmp_path / "raw.json").read_text())
    assert sorted(merged) == ["broken", "table1-amoebanet"] and "unreadable" in merged["broken"]
    figures = figures_module.collect(tmp_path)
    amoeba = figures["table1"]["amoebanet"]
    assert amoeba["remat_params_gain"] == pytest.approx(318 / 82) and amoeba["meets_paper"] is False
    assert figures["tests"]["passed"] == 2 and figures["tests"]["failed"] == ["t::a"]
    assert "raw.json: overhead" in figures["missing"]
    assert not any("bench" in m for m in figures["missing"])  # bench runs only when named, and was not
    # A step the machine cannot run is skipped, not missing.
    assert figures["multigpu"] == {"skipped": "needs two GPUs, this machine has 1"}
    assert not any("multigpu" in m for m in figures["missing"])
    assert [r["step"] for r in figures["steps"]] == ["table1-amoebanet", "multigpu"]
    assert figures["environment"]["date"] and figures["environment"]["code_digest"]  # which code, and when
    # A step stopped at its bound leaves the rows it had measured, said to be partial rather than whole.
    (raw / "fits-amoebanet.json").write_text(json.dumps({"family": "AmoebaNet-D (L, D)", "rows": [], "partial": True}))
    figures_module.main([str(tmp_path), "--raw", str(raw), "--merge-only"])
    assert "raw.json: fits-amoebanet (partial: the step ended before it was done)" in \
        figures_module.collect(tmp_path)["missing"]


# ------------------------------------------------------------------------- the acceptance script

SCRIPTS = Path(__file__).parents[2] / "scripts"
ACCEPTANCE = SCRIPTS / "gpu-acceptance.sh"
# What an acceptance run may leave in OUT_DIR, at most.
MOST_FILES = 8


def _bounds() -> tuple[dict[str, int], dict[str, str]]:
    """The script's time bound of each step, and the comment (the estimate) beside it."""
    text = ACCEPTANCE.read_text()
    table = text[text.index("declare -A BOUND=("):]
    table = table[:table.index("\n)")]
    found = re.findall(r"\[([\w-]+)\]=(\d+)\s*#\s*(.*)", table)
    return {k: int(v) for k, v, _ in found}, {k: c for k, _, c in found}


def test_acceptance_bounds_fit_eight_minutes_and_say_what_each_step_takes() -> None:
    bounds, comments = _bounds()
    steps = re.search(r"^ALL=\((.*)\)$", ACCEPTANCE.read_text(), re.M)
    assert steps is not None
    for name in steps.group(1).split():  # every step has a bound (table1 and bench: one per command)
        assert any(key == name or key.startswith(f"{name}-") or key.startswith(f"{name.rstrip('1')}")
                   for key in bounds), name
    for name in ("table1-amoebanet", "table1-transformer", "fits-amoebanet", "fits-transformer", "bench-k2",
                 "setup", "wheels", "figures"):
        assert name in bounds
    # multigpu runs beside the tests, within their bound; the other default steps one after the other.
    assert bounds["multigpu"] <= bounds["tests"]
    default = re.search(r"^DEFAULT=\((.*)\)$", ACCEPTANCE.read_text(), re.M)
    assert default is not None and "bench" not in default.group(1).split()
    # wheels: only where a dependency is missing, checked again then.
    assert sum(v for k, v in bounds.items() if k not in ("multigpu", "bench-k2", "wheels")) < 480
    for name, comment in comments.items():
        assert re.search(r"\b(est|measured) \d+", comment), (name, comment)


def _acceptance(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # Under --cpu the script ends itself within 480 s (its steps' bounds cut to fit): this waits longer, within
    # the 600 s a test may take, so that a loaded machine gets the script's own record of what ran past its bound.
    return subprocess.run(["bash", str(ACCEPTANCE), *args], capture_output=True, text=True, timeout=540,
                          env={**os.environ, "PYTHON": sys.executable, **env}, cwd=ACCEPTANCE.parents[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_acceptance_without_a_gpu_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    # A slower machine's scale: beside the suite's other worker, Python took over the 10 s bound to import torch.
    proc = _acceptance(tmp_path / "out", str(tmp_path / "out"), GPU_ACCEPTANCE_BOUND_SCALE="12")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stdout + proc.stderr
    assert "no CUDA GPU is visible" in lines[0] and not (tmp_path / "out").exists()


def test_acceptance_skips_multigpu_with_one_gpu_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _acceptance(out, "--cpu", str(out), "multigpu", GPU_ACCEPTANCE_GPUS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("needs two GPUs") == 1
    assert "multigpu: needs two GPUs, this machine has 1: skipped" in proc.stdout.splitlines()
    # It said the GPU steps' bounds, scaled for a CPU start, added up to 709 s: --cpu caps the run itself.
    assert "gpu-acceptance: --cpu; the run is bounded at 480 s in all" in proc.stdout.splitlines()
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["status"]) for r in records] == [("multigpu", "skipped")]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["multigpu"]["skipped"].startswith("needs two GPUs")
    assert len(list(out.iterdir())) <= MOST_FILES


def test_acceptance_records_a_step_past_its_bound_and_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _acceptance(out, "--cpu", str(out), "overhead", "messages", "multigpu", GPU_ACCEPTANCE_BOUND_SCALE="0.01",
                       GPU_ACCEPTANCE_GPUS="0")
    assert proc.returncode == 1 and "FAILED: overhead messages" in proc.stderr, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["status"]) for r in records] == [("multigpu", "skipped"), ("overhead", "timed out"),
                                                           ("messages", "timed out")]
    assert records[1]["bound_s"] == 1 and records[1]["exit_code"] == 124
    files = sorted(p.name for p in out.rglob("*"))
    assert len(files) <= MOST_FILES and set(files) <= {"acceptance.log", "junit.xml", "steps.jsonl", "raw.json",
                                                       "figures.json"}, files
    assert "== messages (bound 1 s)" in (out / "acceptance.log").read_text()


@pytest.mark.slow
def test_acceptance_on_the_cpu_runs_every_step_into_at_most_eight_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _acceptance(out, "--cpu", str(out), GPU_ACCEPTANCE_GPUS="2", GPU_ACCEPTANCE_BOUND_SCALE="4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.rglob("*"))
    assert files == ["acceptance.log", "figures.json", "junit.xml", "raw.json", "steps.jsonl"], files
    figures = json.loads((out / "figures.json").read_text())
    assert figures["multigpu"]["passed"] and len(figures["multigpu"]["runs"]) == 5
    runs = figures["multigpu"]["runs"]  # every schedule trains as gpipe does, and the translation model decodes
    assert runs["translation-bleu"]["bleu"] >= 0
    measure = _script("gpu_measure")
    assert all(runs[name]["loss_gap_vs_gpipe"] <= measure.SAME_TRAINING
               for name in ("lm-1f1b", "lm-zero-bubble", "lm-interleaved"))
    assert figures["engine_overhead"]["rows"] and figures["sync_debug"]
    assert figures["missing"] == [] and figures["bench"]["K=2"]["samples_per_s"] > 0  # --cpu runs bench too
    table1 = figures["table1"]["transformer"]
    assert table1["correction"]["meter"].startswith("saved-tensor accounting")  # the probe ran, as on a GPU
    rows = table1["on_gpu"]
    assert set(rows) == {"naive-1", "pipeline-1", "v-half-1", "offload-1"}
    for name, row in rows.items():  # on the CPU the meter is the accounting the prediction comes from
        assert row["trained"] and row["ratio"] == pytest.approx(1.0, abs=0.05), (name, row)
    assert rows["v-half-1"]["schedule"] == "v-half" and rows["offload-1"]["offload"] == "activations"
    checks = table1["checks"]
    assert checks["remat_within_5pct"]["passed"] is True and isinstance(checks["offload_gain"]["passed"], bool)
    assert {r["status"] for r in figures["steps"]} == {"passed"}


# ------------------------------------------------------------------------- gpu_measure.py

def test_overhead_plain_loop_computes_the_engines_loss_with_and_without_rematerialization(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    measure = _script("gpu_measure")
    out = tmp_path / "overhead.json"
    assert measure.main(["overhead", "--device", "cpu", "--layers", "2", "--d-model", "32", "--ff", "64", "--heads",
                         "2", "--seq-len", "8", "--vocab-size", "64", "--batches", "3,8", "--microbatches", "1,4",
                         "--precisions", "fp32", "--steps", "1", "--warmup", "1", "--rounds", "1", "--round-s", "0",
                         "--sync-batch", "8", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    rows = [(r["batch_size"], r["microbatches"], r["checkpoint"]) for r in figures["rows"]]
    # The goals' rows first; M=1 without rematerialization only; M > batch cannot be cut.
    assert rows[:3] == [(3, 1, "never"), (8, 1, "never"), (8, 4, "except_last")]
    assert sorted(rows) == sorted([(3, 1, "never"), (8, 1, "never"), (8, 4, "except_last"), (8, 4, "never")])
    for row in figures["rows"]:  # same weights, same micro-batches (3 and 8 do not split evenly), same weighting
        assert row["loss_gap"] < 1e-5, row
        assert row["engine_samples_per_s"] > 0 and row["plain_samples_per_s"] > 0
    assert {(r["side"], r["microbatches"]) for r in figures["sync_debug"]} == {
        ("engine", 1), ("plain", 1), ("engine", 4), ("plain", 4)}
    assert all(r["per_step"] == 0 for r in figures["sync_debug"])  # nothing to wait for on the CPU
    # Where a short step's host time goes, each side at the smallest batch and M=1.
    assert [(r["side"], r["batch_size"]) for r in figures["host_profile"]] == [("engine", 3), ("plain", 3)]
    assert all(r["operators_s"] > 0 and r["heaviest"] for r in figures["host_profile"])
    assert "USDT" not in capfd.readouterr().err  # the profiler's own lines at its start and stop stay out of the log


def test_the_host_profile_counts_operators_inside_the_engines_named_ranges() -> None:
    # The engine names each action's range while a profiler records: they were its "operators", 36 against the
    # loop's 265, and its heaviest was "bwd mb0".
    measure = _script("gpu_measure")
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with measure.profiling.quiet(), torch.profiler.profile(activities=cpu) as prof, \
            torch.profiler.record_function("fwd mb0"):
        torch.ones(4, 4) @ torch.ones(4, 4)
    names = [e.name for e in measure.top_level(prof.events())]
    assert "fwd mb0" not in names and "aten::matmul" in names and "aten::mm" not in names  # mm: inside matmul


def test_overhead_stops_starting_rows_past_its_budget() -> None:
    measure = _script("gpu_measure")
    configs = measure.overhead_configs(["bf16", "fp32"], [8, 32], [1, 4, 16], ["never", "except_last"])
    goals = [c for c in configs if (c[2], c[3]) in measure.OVERHEAD_GOALS]
    assert configs[:len(goals)] == goals and len(goals) == 8
    assert ("bf16", 8, 16, "never") not in configs and ("fp32", 32, 16, "except_last") in configs


def test_overhead_prices_a_row_by_the_longest_of_its_precision_and_batch() -> None:
    measure = _script("gpu_measure")
    rows = [{"precision": "fp32", "batch_size": 128, "seconds": 7.0}, {"precision": "fp32", "batch_size": 128,
            "seconds": 9.0}, {"precision": "fp32", "batch_size": 8, "seconds": 30.0},
            {"precision": "bf16", "batch_size": 128, "seconds": 40.0}]
    assert measure.row_seconds("fp32", 128, rows) == 9.0
    # A row of a batch not measured yet: its precision's nearest batch, scaled up to it (priced at 0, the first fp32
    # row at batch 128 started at 55 s of a 55 s budget and ran 9 s past the step's bound).
    assert measure.row_seconds("fp32", 16, rows) == 60.0 and measure.row_seconds("fp32", 100, rows) == 9.0
    assert measure.row_seconds("fp16", 128, rows) == 40.0 and measure.row_seconds("fp16", 256, [rows[2]]) == 960.0
    assert measure.row_seconds("bf16", 8, []) == 0.0
    # The H200's timed-out step: 55 s of rows, the last fp32 batch-128 row started at 50 s after one of 7 s.
    assert 50 + measure.ROW_MARGIN * measure.row_seconds("fp32", 128, rows[:1]) > 55


def test_multigpu_runs_cover_every_schedule_with_messages_over_8_mib() -> None:
    measure = _script("gpu_measure")
    args = measure.parser().parse_args(["multigpu", "--json", "x.json"])
    two = measure.multigpu_runs(args, 2)
    assert [r["name"] for r in two] == ["lm-gpipe", "lm-1f1b", "lm-zero-bubble", "lm-interleaved", "translation-bleu"]
    assert all(r["message_bytes"] > 8 * MiB for r in two[:4])
    interleaved = next(r for r in two if r["schedule"] == "interleaved")
    assert "pipeline.virtual_stages=2" in interleaved["sets"] and args.microbatches % 2 == 0
    four = measure.multigpu_runs(args, 4)
    assert [r["name"] for r in four if r["data_parallel"] == 2] == ["lm-gpipe-dp2"]
    assert next(r for r in four if r["data_parallel"] == 2)["ranks"] == 4


def test_multigpu_needs_two_gpus_and_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    measure = _script("gpu_measure")
    args = measure.parser().parse_args(["multigpu", "--gpus", "1", "--json", str(tmp_path / "m.json")])
    figures = measure.multigpu(args)
    assert figures == {"skipped": "multigpu: needs two GPUs, this machine has 1: skipped", "gpus": 1}
    assert capsys.readouterr().out.strip().splitlines() == [figures["skipped"]]


def test_multigpu_run_checks_catch_what_must_fail() -> None:
    measure = _script("gpu_measure")
    train = [{"kind": "train", "loss": 6.0}, {"kind": "train", "loss": 5.5}]
    assert measure.check_run(0, train, 2, False) == []
    assert measure.check_run(None, train, 2, False) == ["ran past its time bound"]
    assert measure.check_run(1, train, 2, False) == ["exit code 1"]
    assert "non-finite loss" in measure.check_run(0, [train[0], {"kind": "train", "loss": float("nan")}], 2, False)[0]
    assert measure.check_run(0, train[:1], 2, False) == ["1 train records, expected 2"]
    assert "no finite BLEU" in measure.check_run(0, train, 2, True)[0]
    assert measure.check_run(0, [*train, {"kind": "eval", "bleu": 3.5}], 2, True) == []
    runs: list[dict[str, Any]] = [
        {"name": "lm-gpipe", "passed": True, "data_parallel": 1, "losses": [6.0, 5.5], "problems": []},
        {"name": "lm-1f1b", "passed": True, "data_parallel": 1, "losses": [6.0, 5.5 + 1e-6], "problems": []},
        {"name": "lm-zero-bubble", "passed": True, "data_parallel": 1, "losses": [6.0, 5.6], "problems": []}]
    measure.compare_schedules(runs)
    assert runs[1]["passed"] and not runs[2]["passed"] and "differ from gpipe's" in runs[2]["problems"][0]


def test_fits_trains_each_row_of_a_budget_table_on_the_cpu(tmp_path: Path) -> None:
    measure = _script("gpu_measure")
    fixed = {"arch": "decoder-only", "d_model": 16, "ff": 32, "heads": 2, "vocab_size": 64, "max_len": 8}
    rows = [{"scenario": "naive-1", "partitions": 1, "microbatches": 1, "checkpoint": "never", "model": "1"},
            {"scenario": "pipeline-1", "partitions": 1, "microbatches": 2, "checkpoint": "except_last", "model": "2"}]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"family": "Transformer-L", "kind": "transformer", "fixed": fixed, "batch_size": 4,
                                 "optimizer": "rmsprop", "budget_bytes": 1 << 40, "rows": rows}))
    out = tmp_path / "fits.json"
    assert measure.main(["fits", "--device", "cpu", "--table", str(table), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["trained"] for r in figures["rows"]] == [True, True] and "resident" in figures["method"]


@pytest.mark.parametrize("own", [{}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
                                 {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}])
def test_cuda_allocator_grows_segments_in_place_unless_the_user_chose(own: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k} | own
    code = "import os, gpipe_cli; print(*map(os.environ.get, ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    expected = (own.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True" if not own else None),
                own.get("PYTORCH_ALLOC_CONF"))
    assert out.split() == [str(v) for v in expected]
