"""What the GPU acceptance tests do and check, with the device as a parameter.

Every check here runs on the CPU in CI (device "cpu") and on a CUDA GPU in the acceptance (device
"cuda"): only the device differs. Runs go through the real command line and are read back from
what a user gets (metrics.jsonl, checkpoints, the --json files of bench and profile-memory).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_AMOEBANET, TINY_TRANSLATION, write

MiB = 2**20

# Relative tolerances on the loss (the gradient norm gets twice as much: it is a sum of squares).
# fp32 across devices: the same arithmetic in another order (CPU vs CUDA kernels, cuDNN and
# attention kernels); rounding at 2^-24 per operation stays far below 1e-3 over a few steps.
# bf16 and fp16: the unit roundoff (2^-8 and 2^-11) times 10, for error accumulated over the
# layers and steps; a wrong loss scale, a missed unscale or a dropped micro-batch moves the loss or
# the gradient norm by far more.
TOLERANCE = {"fp32": 1e-3, "bf16": 4e-2, "fp16": 5e-3}
# The same device with a different K: the same kernels on the same shapes, so the only differences
# are kernels that are not bitwise reproducible across processes (cuDNN convolution backward,
# atomic adds), ~1e-6 per step.
SAME_DEVICE = 1e-3

# A K=1 Transformer for the precision and checkpoint checks: no dropout, because dropout masks come
# from each device's own generator (the weights do not: layers are initialised on the CPU).
PRECISION_RECIPE: dict[str, Any] = copy.deepcopy(TINY_TRANSLATION)
PRECISION_RECIPE["model"]["dropout"] = 0.0
PRECISION_RECIPE["pipeline"] = {"partitions": 1, "microbatches": 3}
PRECISION_RECIPE["train"] = {"steps": 4}
PRECISION_RECIPE["checkpoint"] = {"every": 2, "keep": 5}

# AmoebaNet (convolutions, deferred BatchNorm, dropout) for K ranks against K=1 on one device.
PARTITION_RECIPE: dict[str, Any] = copy.deepcopy(TINY_AMOEBANET)
PARTITION_RECIPE["eval"] = {}


@dataclass
class Run:
    """A finished `gpipe train` run."""

    run_dir: Path
    stderr: str

    def records(self, kind: str = "train") -> list[dict[str, Any]]:
        """The metrics.jsonl records of one kind, in order."""
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    def series(self, key: str) -> dict[int, float]:
        """One figure of every train record, by step."""
        return {r["step"]: float(r[key]) for r in self.records()}

    def stage_peaks(self) -> list[list[int]]:
        """Per-stage memory peaks of every step that has them (the CUDA allocator's on CUDA, every step; stored
        activations on the CPU, on the steps that count them)."""
        return [r["mem_peak_bytes"] for r in self.records() if "mem_peak_bytes" in r]


def gpipe(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Run the command line as a user would."""
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def train(folder: Path, recipe: dict[str, Any], device: str, *sets: str, resume: bool = False,
          as_ranks: bool = False) -> Run:
    """Train `recipe` on `device` into folder/run (or continue the run there with `resume`), `as_ranks` or launched."""
    folder.mkdir(parents=True, exist_ok=True)
    path = write(folder, recipe)
    args = [str(path), "--output-dir", str(folder / "run"), "--set", f"train.device={device}"]
    for item in sets:
        args += ["--set", item]
    if resume:
        args.append("--resume")
    if as_ranks:  # as torchrun's ranks, forked from the suite's preloaded server: no launcher, no Python start
        pipe = recipe["pipeline"]
        ranks = gpipe_train(pipe["partitions"] * pipe.get("data_parallel", 1), *args)
        code, stderr = ranks.code, ranks.stderr
    else:
        proc = gpipe("train", *args, "--plain", "--threads", "1")
        code, stderr = proc.returncode, proc.stderr
    assert code == 0, f"gpipe train {' '.join(args)} failed:\n{stderr[-4000:]}"
    return Run(folder / "run", stderr)


def relative_gap(actual: float, expected: float) -> float:
    """|actual - expected| relative to |expected| (absolute below 1)."""
    return abs(actual - expected) / max(abs(expected), 1.0)


def assert_close(actual: dict[int, float], expected: dict[int, float], rel: float, what: str) -> None:
    """The same steps, each figure within `rel` of the expected one."""
    assert sorted(actual) == sorted(expected), f"{what}: steps {sorted(actual)} != {sorted(expected)}"
    gaps = {step: relative_gap(actual[step], expected[step]) for step in expected}
    worst = max(gaps, key=lambda s: gaps[s])
    assert gaps[worst] <= rel, (f"{what}: step {worst} is {actual[worst]:.6g}, expected {expected[worst]:.6g} "
                                f"(relative gap {gaps[worst]:.2e} > {rel:.0e})")


def loss_scale(run_dir: Path, step: int) -> tuple[float, int]:
    """The fp16 loss scale and its count of clean steps, as the checkpoint after `step` holds them."""
    import torch.distributed.checkpoint as dcp

    from gpipe_cli.train import checkpoint
    from gpipe_cli.train.safe_dcp import SafeLoadPlanner, SafeReader

    state = {"train": {"loss_scale": torch.zeros(2, dtype=torch.float64)}}
    with checkpoint.single_process_quiet(distributed=False):
        dcp.load(state, storage_reader=SafeReader(str(checkpoint.path_for(run_dir, step))),
                 planner=SafeLoadPlanner(), no_dist=True)
    value, good = state["train"]["loss_scale"].tolist()
    return value, int(good)


def check_precision(run: Run, reference: Run, precision: str) -> None:
    """`run` (any device, `precision`) trained like the fp32 reference, and fp16 scaled its loss dynamically."""
    tolerance = TOLERANCE[precision]
    assert_close(run.series("loss"), reference.series("loss"), tolerance, f"{precision} loss")
    assert_close(run.series("grad_norm"), reference.series("grad_norm"), 2 * tolerance, f"{precision} grad norm")
    assert not any(r.get("skipped") for r in run.records()), "a step was skipped: non-finite gradients"
    steps = max(run.series("loss"))
    value, good = loss_scale(run.run_dir, steps)
    expected = (2.0**16, steps) if precision == "fp16" else (1.0, 0)  # fp16: never overflowed, not yet grown
    assert (value, good) == expected, f"{precision}: loss scale {value} after {good} clean steps, expected {expected}"


def resume_on(run: Run, recipe: dict[str, Any], folder: Path, device: str, keep_step: int, *sets: str,
              as_ranks: bool = False) -> Run:
    """Continue a copy of `run` on `device` from its checkpoint after `keep_step`, to the end."""
    target = folder / "run"
    shutil.copytree(run.run_dir, target)
    for checkpoint in (target / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[1]) > keep_step:
            shutil.rmtree(checkpoint)
    resumed = train(folder, recipe, device, *sets, resume=True, as_ranks=as_ranks)
    assert "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    return resumed


def check_resumed(resumed: Run, uninterrupted: Run, rel: float) -> None:
    """The resumed run ends like the uninterrupted one, step for step."""
    assert_close(resumed.series("loss"), uninterrupted.series("loss"), rel, "resumed loss")
    assert_close(resumed.series("grad_norm"), uninterrupted.series("grad_norm"), 2 * rel, "resumed grad norm")


def check_same_training(run: Run, reference: Run, stages: int) -> None:
    """K ranks on one device trained like K=1 there, and every stage reported its memory peak."""
    assert_close(run.series("loss"), reference.series("loss"), SAME_DEVICE, f"K={stages} loss")
    assert_close(run.series("grad_norm"), reference.series("grad_norm"), 2 * SAME_DEVICE, f"K={stages} grad norm")
    peaks_of_steps = run.stage_peaks()
    assert peaks_of_steps, "no step reported its memory"
    for peaks in peaks_of_steps:
        assert len(peaks) == stages and all(p > 0 for p in peaks), peaks


# ---------------------------------------------------------------------------------------- memory

# What the allocator may hold beyond the accounted activations, weights and gradients: the cuBLAS
# and cuBLASLt workspaces (tens of MiB on recent GPUs) and allocator rounding.
ALLOCATOR_SLACK = 256 * MiB
# Tensors alive only inside an operation or a backward step (gradients flowing between layers) are
# real allocations that saved-tensor accounting does not count; at most half again what is stored.
TRANSIENT = 1.5


def stage_param_bytes(bench: dict[str, Any]) -> list[int]:
    """fp32 parameter bytes of each stage of a bench run (from its model and balance)."""
    from gpipe_cli.estimate.subject import Subject
    from gpipe_cli.models.describe import describe
    from gpipe_cli.pipeline.partition import stage_ranges

    counts = [layer.params for layer in describe(Subject.from_json(bench["model"]).build(), 1).layers]
    return [4 * sum(counts[i] for i in span) for span in stage_ranges(bench["balance"])]


def check_stage_peaks(stages: list[dict[str, Any]], param_bytes: list[int], device: str) -> None:
    """Per stage: the CUDA allocator's peak holds the accounted activations and not much more (CUDA);
    the accounting alone on the CPU."""
    assert len(stages) == len(param_bytes) and stages, (stages, param_bytes)
    for s, params in zip(stages, param_bytes):
        accounted, allocator = s["activation_peak_bytes"], s["cuda_peak_bytes"]
        assert accounted > 0, f"stage {s['stage']}: no activations accounted"
        if device != "cuda":
            assert allocator == 0, f"stage {s['stage']}: a CUDA peak ({allocator}) off CUDA"
            continue
        # Every accounted tensor is a live CUDA allocation of the same process, and both peaks are
        # reset at the start of each step: the allocator's peak cannot be lower (1 MiB for stray
        # host tensors autograd may save).
        assert accounted <= allocator + MiB, f"stage {s['stage']}: accounted {accounted} > allocator {allocator}"
        bound = TRANSIENT * accounted + 2 * params + ALLOCATOR_SLACK  # + weights and gradients
        assert allocator <= bound, (f"stage {s['stage']}: allocator peak {allocator} exceeds accounted activations "
                                    f"{accounted}, weights and gradients ({2 * params}) and slack: {bound:.0f}")


def bench(folder: Path, *args: str) -> dict[str, Any]:
    """`gpipe bench ... --json` (on CUDA when the machine has it); its figures."""
    out = folder / "bench.json"
    proc = gpipe("bench", *args, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def profile_memory(folder: Path, device: str, *args: str) -> dict[str, Any]:
    """`gpipe profile-memory --device DEVICE ... --json`; its figures."""
    out = folder / f"profile-{device}.json"
    proc = gpipe("profile-memory", "--device", device, *args, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def check_profile(measured: dict[str, Any], reference: dict[str, Any], device: str) -> None:
    """A profile on `device` against the CPU's exact accounting of the same model and cuts."""
    assert measured["device"].startswith(device), measured["device"]
    assert ("CUDA allocator" in measured["method"]) == (device == "cuda"), measured["method"]
    names = [s["name"] for s in measured["scenarios"]]
    assert names == [s["name"] for s in reference["scenarios"]], names
    for mine, theirs in zip(measured["scenarios"], reference["scenarios"]):
        assert mine["balance"] == theirs["balance"], (mine["balance"], theirs["balance"])
        for a, b in zip(mine["stages"], theirs["stages"]):
            # Weights, gradients and optimizer state are fp32 tensors of the same shapes everywhere.
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert a[key] == b[key], (mine["name"], a["stage"], key, a[key], b[key])
            assert a["stored_bytes"] > 0 and a["peak_bytes"] > 0, (mine["name"], a)
            # The allocator rounds up and also holds what a stage sent; it once read a later stage's inputs as
            # the stage before it (freed during the measurement), so that most stages of K=8 read 0 B.
            assert a["stored_bytes"] >= 0.5 * b["stored_bytes"], (mine["name"], a["stage"], a, b)
    by_name = {s["name"]: s for s in measured["scenarios"]}
    # Rematerialization: pipeline-1 holds fewer activations than naive training of the same model.
    assert by_name["pipeline-1"]["stages"][0]["peak_bytes"] < by_name["naive-1"]["stages"][0]["peak_bytes"]
