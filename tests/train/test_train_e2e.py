"""`gpipe train` end to end on CPU: real launcher, real ranks, real files."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import free_port
from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_AMOEBANET, TINY_TRANSLATION, write

pytestmark = pytest.mark.slow

TRAIN_FIELDS = {"kind", "step", "epoch", "loss", "lr", "samples_per_s", "step_time_s", "bubble", "bubble_theory",
                "rss_peak_bytes", "grad_norm", "tflops", "mfu"}


def gpipe(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Each family runs K=1 (the reference), K=2 and K=3 (a first, a middle and a last stage), and the two families
# share out the schedules so that every (K, schedule) pair goes through the launcher once: the schedule plumbing
# does not depend on the model. The K=1 reference runs as torchrun's one rank would (no launcher to prove there).
# The full K x M x schedule product is compared parameter by parameter in tests/pipeline/test_engine.py and
# tests/models/test_model_pipeline.py; here it is the launcher, data, loss and metrics around the engine.
CUTS = {"translation": [(1, "gpipe"), (2, "1f1b"), (3, "gpipe")],
        "amoebanet": [(1, "gpipe"), (2, "gpipe"), (3, "1f1b")]}
STEPS = 3


@pytest.fixture(scope="module", params=["translation", "amoebanet"])
def cuts(request, tmp_path_factory) -> dict[tuple[int, str], tuple[dict, Path, subprocess.CompletedProcess]]:
    """One family trained on every cut of CUTS: (K, schedule) -> (recipe, run folder, finished process)."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    recipe = copy.deepcopy(TINY_TRANSLATION if family == "translation" else TINY_AMOEBANET)
    recipe["model"]["dropout"] = 0.0
    recipe["train"]["steps"] = STEPS
    recipe["eval"] = {"batches": 1}  # after the last step only: it cannot change a training loss
    if family == "amoebanet":
        # At 32 px the last cells are 1x1, so BatchNorm over a 4-example micro-batch normalises 4 numbers and
        # turns rounding into percent-size changes within two steps; 64 px keeps the comparison well posed.
        recipe["model"]["image_size"] = 64
        recipe["optimizer"]["lr"] = 0.02
    runs = {}
    for stages, schedule in CUTS[family]:
        recipe["pipeline"].update(partitions=stages, schedule=schedule)
        name = f"k{stages}-{schedule}"
        out = folder / name
        # One intra-op thread everywhere: a multithreaded kernel sums in another order, and that rounding,
        # not the pipeline, is what would differ between a 1-rank and a 2-rank run on this machine.
        args = [str(write(folder, recipe, f"{name}.yaml")), "--output-dir", str(out), "--threads", "1"]
        if stages == 1:
            ranks = gpipe_train(1, *args)  # the ranks' stdout and stderr together: both are searched below
            proc = subprocess.CompletedProcess(args, ranks.code, ranks.output, ranks.output)
        else:
            proc = gpipe("train", *args, "--plain")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[(stages, schedule)] = (copy.deepcopy(recipe), out, proc)
    return runs


def test_a_run_writes_every_metric(cuts):
    for (stages, schedule), (recipe, out, proc) in cuts.items():
        microbatches = recipe["pipeline"]["microbatches"]
        steps = [r for r in records(out) if r["kind"] == "train"]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        for r in steps:
            assert set(r) >= TRAIN_FIELDS
            # On the CPU the memory peak is the stored activations, counted on the first step and every 10th.
            assert ("mem_peak_bytes" in r) == (r["step"] == 1 or r["step"] % 10 == 0)
            peaks = r.get("mem_peak_bytes", [1] * stages)
            assert len(peaks) == stages and all(m > 0 for m in peaks)
            assert 0.0 <= r["bubble"] < 1.0
            assert r["bubble_theory"] == pytest.approx((stages - 1) / (microbatches + stages - 1)), (stages, schedule)
        if recipe["model"]["kind"] == "transformer":
            assert all(r["tokens_per_s"] > 0 for r in steps)
        evals = [r for r in records(out) if r["kind"] == "eval"]
        assert evals and all({"step", "loss", "accuracy"} <= set(r) for r in evals)
        assert (out / "recipe.yaml").exists() and (out / "checkpoints").is_dir()
        # Each checkpoint keeps the settings it was trained with, listed and checked as its other files.
        for saved in (out / "checkpoints").glob("step-*"):
            assert (saved / "recipe.yaml").read_text() == (out / "recipe.yaml").read_text()
            assert "recipe.yaml" in json.loads((saved / "manifest.json").read_text())["checksums"]
        if recipe["model"]["kind"] == "transformer":
            assert (out / "tokenizer.model").exists()
        assert "step 1/" in proc.stdout and "Traceback" not in proc.stderr
        assert all(r["tflops"] > 0 and r["mfu"] > 0 for r in steps) and "MFU" in proc.stdout
        if stages > 1:  # balance: auto measures, or reads what an earlier launch measured
            assert "(cut by measured time" in proc.stdout, proc.stdout[-2000:]
    # Model FLOPs count the model's work only: a step's are the same whatever the cut, schedule or recompute.
    per_step = [[r["tflops"] * r["step_time_s"] for r in records(out) if r["kind"] == "train"]
                for _, out, _ in cuts.values()]
    assert all(flops == pytest.approx(per_step[0], rel=1e-6) for flops in per_step)


def test_losses_agree_for_any_number_of_stages_and_both_schedules(cuts):
    losses = {key: [r["loss"] for r in records(out) if r["kind"] == "train"] for key, (_, out, _) in cuts.items()}
    reference = losses[(1, "gpipe")]
    assert len(reference) == STEPS
    for key, values in losses.items():
        recipe = cuts[key][0]
        # A schedule that runs the backwards in another order sums each gradient in another order, and AmoebaNet-D's
        # BatchNorm over small maps grows that rounding some 300-fold a step (1F1B against GPipe on an AVX2 CPU:
        # 2e-7, 6e-5, then 1e-2 after steps 2, 3 and 4): its losses are compared before that.
        steps = 3 if recipe["model"]["kind"] == "amoebanet" and key[1] != "gpipe" else STEPS
        assert values[:steps] == pytest.approx(reference[:steps], rel=1e-4), key


def test_data_parallel_reports_the_loss_of_the_whole_mini_batch(cuts, tmp_path):
    # K=1 x D=2: rank 0 is a last stage too, and its replica's share alone is half the mini-batch's loss.
    recipe, _, _ = cuts[(1, "gpipe")]
    if recipe["model"]["kind"] != "transformer":
        pytest.skip("one family is enough: the loss is summed over replicas alike for both")
    recipe = copy.deepcopy(recipe)
    recipe["pipeline"].update(partitions=1, data_parallel=2, schedule="gpipe")
    out = tmp_path / "d2"
    ranks = gpipe_train(2, str(write(tmp_path, recipe, "d2.yaml")), "--output-dir", str(out), "--threads", "1")
    assert ranks.code == 0, ranks.output[-4000:]
    losses = [r["loss"] for r in records(out) if r["kind"] == "train"]
    reference = [r["loss"] for r in records(cuts[(1, "gpipe")][1]) if r["kind"] == "train"]
    assert losses == pytest.approx(reference, rel=1e-4)
    # The samples of the whole mini-batch over its step's time, not one replica's share of them.
    assert all(r["samples_per_s"] == pytest.approx(recipe["data"]["batch_size"] / r["step_time_s"])
               for r in records(out) if r["kind"] == "train")


def test_two_processes_act_as_two_nodes_of_one_job(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["steps"] = 2
    path = write(tmp_path, recipe)
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["train", str(path), "--plain", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--threads", "1"]
    nodes = [subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", *common, "--node-rank", str(rank),
                               "--output-dir", str(tmp_path / "run")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert len([r for r in records(tmp_path / "run") if r["kind"] == "train"]) == 2


@pytest.mark.parametrize("node_1", [["--set", "model.filters=16"], ["--nnodes", "4"]], ids=["recipe", "nnodes"])
def test_nodes_started_differently_are_refused_in_one_line(tmp_path, node_1):
    # Another recipe on node 1 aborted node 0's ranks in gloo (SIGABRT and their thread dumps); another --nnodes
    # formed a job of 3 processes, each rank a traceback.
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["pipeline"]["data_parallel"] = 2
    path = write(tmp_path, recipe)
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["train", str(path), "--plain", "--rdzv-endpoint", endpoint, "--threads", "1",
              "--output-dir", str(tmp_path / "run")]
    nodes = [subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", *common, "--node-rank", str(rank), "--nnodes",
                               "2", *(node_1 if rank else [])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [2, 2], outputs
    errors = "".join(err for _, err in outputs)
    assert "Traceback" not in errors and "Fatal Python error" not in errors, errors[-3000:]
    said = {"recipe": "the nodes were given different recipes: model.filters is 16 on rank 2 and 8 on rank 0",
            "nnodes": "the job has 3 processes but partitions × data_parallel = 2 × 2 = 4; start every node of the "
                      "job with the same --nnodes and recipe"}
    assert said["recipe" if "--set" in node_1 else "nnodes"] in errors, errors[-3000:]


def test_under_torchrun_it_just_runs_as_the_given_rank(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["steps"] = 2
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "gpipe_cli.cli", "train",
                           str(write(tmp_path, recipe)), "--output-dir", str(out), "--plain"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(out) if r["kind"] == "train"] == [1, 2]
