"""The CUDA paths one GPU can exercise, through the command line (skipped without CUDA).

    K=1 on CUDA in fp32, bf16 and fp16 (dynamic loss scaling)  against the CPU in fp32
    K=2 and K=4 ranks sharing the GPU (host-memory transport)    against K=1 on the GPU (tied weights too)
    checkpoints written on one device, resumed on the other      against the uninterrupted run
    gpipe bench: CUDA allocator peaks per stage                  against the activation accounting
    gpipe profile-memory --device cuda                           against the CPU's exact accounting
    gpipe plan: layers and engine steps timed on the GPU           a plan whose pick trains as written
    offloaded activations (side stream, pinned memory)           the same gradients, a lower allocator peak
    fp16's first steps skipped on the device (fused optimizers)  the same parameters as without them

NCCL between two GPUs is the one path a single GPU cannot run (see docs/gpus-and-nodes.md).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import runs
from tests.gpu.runs import PARTITION_RECIPE, PRECISION_RECIPE, Run

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def once(factory: pytest.TempPathFactory, name: str, recipe: dict[str, Any], device: str, *sets: str) -> Run:
    """A reference run trained once for the whole session, whichever xdist worker asks first."""
    # Workers' temporary folders share a parent that is new each session: the first worker to take the lock
    # trains, the others wait and read its run (a module fixture would train it again on every worker).
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"reference-{name}"
    with open(root / f"reference-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "stderr.txt"
        if not done.exists():
            run = runs.train(folder, recipe, device, *sets)
            done.write_text(run.stderr)
        return Run(folder / "run", done.read_text())


@pytest.fixture(scope="session")
def cpu_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return once(tmp_path_factory, "cpu", PRECISION_RECIPE, "cpu")


@pytest.fixture(scope="session")
def cuda_fp32(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return once(tmp_path_factory, "cuda-fp32", PRECISION_RECIPE, "cuda")


@pytest.fixture(scope="session")
def cuda_k1(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return once(tmp_path_factory, "cuda-k1", PARTITION_RECIPE, "cuda", "pipeline.partitions=1")


# Each precision's tolerance, and why it is what it is: runs.TOLERANCE (and runs.SAME_DEVICE below).
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_k1_on_cuda_trains_like_the_cpu(precision: str, cpu_reference: Run, cuda_fp32: Run, tmp_path: Path) -> None:
    run = cuda_fp32 if precision == "fp32" else runs.train(tmp_path, PRECISION_RECIPE, "cuda",
                                                            f"train.precision={precision}")
    runs.check_precision(run, cpu_reference, precision)
    assert all(len(p) == 1 and p[0] > 0 for p in run.stage_peaks())


@pytest.mark.parametrize("model, stages", [("amoebanet", 2), ("amoebanet", 4), ("transformer", 2)])
def test_ranks_sharing_the_gpu_train_like_k1(model: str, stages: int, request: pytest.FixtureRequest,
                                             tmp_path: Path) -> None:
    # The Transformer ties its embedding and softmax: with K=2 the copies live on two ranks.
    recipe, name = (PARTITION_RECIPE, "cuda_k1") if model == "amoebanet" else (PRECISION_RECIPE, "cuda_fp32")
    reference: Run = request.getfixturevalue(name)  # only the reference this case needs
    run = runs.train(tmp_path, recipe, "cuda", f"pipeline.partitions={stages}")
    runs.check_same_training(run, reference, stages)


def test_checkpoint_written_on_cuda_resumes_on_cpu(cuda_fp32: Run, tmp_path: Path) -> None:
    resumed = runs.resume_on(cuda_fp32, PRECISION_RECIPE, tmp_path, "cpu", keep_step=2)
    runs.check_resumed(resumed, cuda_fp32, runs.TOLERANCE["fp32"])


def test_checkpoint_written_on_cpu_resumes_on_cuda(cpu_reference: Run, tmp_path: Path) -> None:
    resumed = runs.resume_on(cpu_reference, PRECISION_RECIPE, tmp_path, "cuda", keep_step=2)
    runs.check_resumed(resumed, cpu_reference, runs.TOLERANCE["fp32"])


# Activations of a few GiB per stage, so that the allocator's fixed workspaces are small beside them.
BENCH_MODEL = ["--model", "transformer", "--set", "model.arch=decoder-only", "--set", "model.dropout=0",
               "--layers", "4", "--d-model", "1024", "--ff", "4096", "--heads", "16", "--seq-len", "256",
               "--vocab-size", "8192"]


def test_bench_on_cuda_reports_allocator_peaks_consistent_with_the_accounting(tmp_path: Path) -> None:
    figures = runs.bench(tmp_path, *BENCH_MODEL, "--partitions", "2", "--microbatches", "4", "--batch-size", "32",
                         "--checkpoint", "never", "--steps", "3", "--warmup", "1")
    assert "CUDA" in figures["memory_method"] and figures["samples_per_s"] > 0 and figures["samples_per_s_k1"] > 0
    runs.check_stage_peaks(figures["stages"], runs.stage_param_bytes(figures), "cuda")
    whole = runs.stage_param_bytes({**figures, "balance": [figures["model"]["layers"]]})
    runs.check_stage_peaks(figures["stages_k1"], whole, "cuda")


# Activations of about a GiB, far above the allocator's workspaces, still quick to account on the CPU.
PROFILE_MODEL = ["--model", "transformer", "--set", "model.arch=decoder-only", "--layers", "4", "--d-model", "512",
                 "--ff", "2048", "--heads", "8", "--seq-len", "256", "--vocab-size", "4096"]


def test_profile_memory_on_cuda_matches_the_cpu_accounting(tmp_path: Path) -> None:
    args = [*PROFILE_MODEL, "--partitions", "2,4", "--microbatches", "4", "--batch-size", "16"]
    cuda = runs.profile_memory(tmp_path, "cuda", *args)
    cpu = runs.profile_memory(tmp_path, "cpu", *args)
    runs.check_profile(cuda, cpu, "cuda")


def test_plan_times_the_layers_and_the_engine_on_the_gpu(tmp_path: Path) -> None:
    planned = tmp_path / "planned.yaml"
    proc = runs.gpipe("plan", "--devices", "2", "--plain", "--output", str(planned))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "per-layer seconds: measured on cuda (" in proc.stdout and "one GPU" in proc.stdout, proc.stdout
    assert "the engine adds" in proc.stdout and "(assumed)" in proc.stdout  # in-process calibration, links assumed
    run = runs.gpipe("train", str(planned), "--set", "train.steps=3", "--output-dir", str(tmp_path / "run"), "--plain")
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.parametrize("checkpoint,schedule", [("never", "gpipe"), ("except_last", "gpipe"),
                                                 ("never", "zero-bubble")])
def test_offloaded_activations_on_cuda_train_alike_and_hold_less(checkpoint: str, schedule: str) -> None:
    """The side-stream copies into pinned memory give the same gradients, with a lower allocator peak (a split
    backward's too, whose device copies go between its B and its W)."""
    import torch

    from gpipe_cli.estimate.subject import example_batch
    from gpipe_cli.models.registry import build_model
    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig
    from gpipe_cli.pipeline.engine import Pipeline
    from gpipe_cli.pipeline.layers import build_layers

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the allocator's statistics need a CUDA context first
    spec = build_model("transformer", arch="decoder-only", layers=6, d_model=512, ff=2048, heads=8, vocab_size=4096,
                       max_len=256, dropout=0.0)
    inputs, targets = example_batch(spec, 16, 0)
    found = {}
    for offload in ("none", "activations"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        n = len(spec.layers)
        pipe = Pipeline(build_layers(spec.factories(), range(n), 0, device), topology.local(device),
                        PipelineConfig(microbatches=4, schedule=schedule, checkpoint=checkpoint, balance=(n,),
                                       offload=offload),
                        spec.loss, units=spec.units)
        before = torch.cuda.memory_allocated(device)
        pipe.train_step(inputs, targets, microbatches=4, step=0)
        torch.cuda.synchronize(device)
        grads = [p.grad.detach().clone() for p in pipe.parameters() if p.grad is not None]
        found[offload] = (grads, torch.cuda.max_memory_allocated(device) - before, pipe.stage.meter.host_peak)
        del pipe
    (plain, plain_peak, _), (moved, moved_peak, host) = found["none"], found["activations"]
    assert len(plain) == len(moved)
    for a, b in zip(plain, moved):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert host > 0 and moved_peak < plain_peak, (moved_peak, plain_peak, host)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_first_step_skipped_on_the_gpu_leaves_the_fused_optimizer_as_if_it_never_ran(name: str) -> None:
    # torch's fused SGD left its momentum uninitialised after skipping an fp16 run's first step: NaN weights.
    from tests.pipeline.test_precision import check_a_skipped_first_step_leaves_no_trace

    check_a_skipped_first_step_leaves_no_trace(name, "cuda")
