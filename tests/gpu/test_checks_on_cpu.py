"""The GPU acceptance's checks, proven on the CPU: the same runs and comparisons with device "cpu",
the checks failing where they must, and the CUDA-only branches of resuming and `train.device`."""

from __future__ import annotations

import importlib.util
import json
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
    reference = runs.train(tmp_path / "fp32", PRECISION_RECIPE, "cpu")
    half = runs.train(tmp_path / "fp16", PRECISION_RECIPE, "cpu", "train.precision=fp16")
    runs.check_precision(half, reference, "fp16")
    runs.check_precision(reference, reference, "fp32")
    resumed = runs.resume_on(reference, PRECISION_RECIPE, tmp_path / "resumed", "cpu", keep_step=2)
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
    pipe = Pipeline(build_layers(factories, range(3), 0), topology.local(), [3], nn.CrossEntropyLoss())
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


def test_figures_collects_what_the_acceptance_wrote_and_names_what_is_missing(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_figures", Path(__file__).parents[2] / "scripts/gpu_figures.py")
    assert spec is not None and spec.loader is not None
    figures_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures_module)
    raw = tmp_path / "raw"
    raw.mkdir()
    rows = [{"scenario": "naive-1", "partitions": 1, "model": "(18, 208)", "params": 82, "device_peak_bytes": 7.0},
            {"scenario": "pipeline-1", "partitions": 1, "model": "(18, 416)", "params": 318, "device_peak_bytes": 7.5}]
    (raw / "table1-amoebanet.json").write_text(json.dumps(
        {"family": "AmoebaNet-D (L, D)", "kind": "amoebanet", "budget_bytes": 8, "batch_size": 128,
         "optimizer": "rmsprop", "method": "accounting", "rows": rows}))
    (tmp_path / "junit.xml").write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
                                        '<testcase classname="t" name="a"><failure/></testcase></testsuite>'
                                        '</testsuites>')
    figures = figures_module.collect(tmp_path)
    amoeba = figures["table1"]["amoebanet"]
    assert amoeba["remat_params_gain"] == pytest.approx(318 / 82) and amoeba["meets_paper"] is False
    assert figures["tests"]["passed"] == 2 and figures["tests"]["failed"] == ["t::a"]
    assert str(raw / "overhead.json") in figures["missing"] and str(raw / "bench-k2.json") in figures["missing"]
