"""Resume, resharding, preemption, corrupt checkpoints and export, through `gpipe train` on CPU."""

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpipe_cli.train.signals import ECHO_S
from tests.interrupt import as_from_a_terminal
from tests.train.as_ranks import gpipe_train, ranks_of
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow


def recipe(steps: int = 8, every: int = 3) -> dict:
    r = copy.deepcopy(TINY_TRANSLATION)
    r["train"]["steps"] = steps
    r["checkpoint"] = {"every": every, "keep": 5}
    r["eval"] = {}
    # A rate that moves at every step: a resume one step off in the schedule trains on other weights.
    r["schedule"] = {"name": "cosine", "warmup_steps": 2}
    return r


def gpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args, "--plain", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("full")
    path = write(folder, recipe())
    # The uninterrupted reference, its ranks forked ready as torchrun's (the resumes below are launched)
    proc = gpipe_train(2, str(path), "--output-dir", str(folder / "run"), "--threads", "1")
    assert proc.codes == [0, 0], proc.stderr[-3000:]
    return path, folder / "run"


def interrupted_copy(run: Path, target: Path, keep_step: int) -> Path:
    """A copy of a finished run as if it had died right after checkpoint `keep_step`."""
    shutil.copytree(run, target)
    for folder in (target / "checkpoints").iterdir():
        if int(folder.name.split("-")[1]) > keep_step:
            shutil.rmtree(folder)
    return target


def _start(path: Path, run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "train", str(path), "--output-dir", str(run),
                             "--plain", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            return proc
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run did not start")


@pytest.mark.parametrize(("ranks", "changes"), [
    (1, ["--set", "pipeline.partitions=1"]), (3, ["--set", "pipeline.partitions=3"]),
    (2, ["--set", "pipeline.balance=[1,5]"]),
    (2, ["--set", "pipeline.schedule=interleaved", "--set", "pipeline.virtual_stages=2",
         "--set", "pipeline.microbatches=4"]),
    (2, ["--set", "pipeline.schedule=zero-bubble", "--set", "pipeline.checkpoint=always"])],
    ids=["K=1", "K=3", "balance", "interleaved-V=2", "zero-bubble"])
def test_resume_with_another_cut_continues_with_the_same_losses(full_run, tmp_path, ranks, changes):
    path, run = full_run
    copy_dir = interrupted_copy(run, tmp_path / "copy", keep_step=6)
    # As torchrun starts the ranks, forked ready: what is proven is the losses, not how the ranks started.
    proc = gpipe_train(ranks, str(path), "--output-dir", str(copy_dir), "--resume", *changes, "--threads", "1")
    assert proc.codes == [0] * ranks, proc.stderr[-3000:]
    resumed, reference = losses(copy_dir), losses(run)
    assert set(resumed) == set(reference)
    for step in (7, 8):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5)


def test_the_recorded_learning_rate_is_the_schedule_over_the_run_s_steps(full_run):
    # The records' rate came from a second copy of the schedule: the optimizer's could differ unseen.
    _, run = full_run
    records = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    expected = [0.001 * min(s / 2, 1) * 0.5 * (1 + math.cos(math.pi * max(s - 3, 0) / 6)) for s in range(1, 9)]
    assert [r["lr"] for r in records] == pytest.approx(expected)


def test_resume_skips_a_truncated_checkpoint_and_equals_the_uninterrupted_run_step_for_step(full_run, tmp_path):
    path, run = full_run
    copy_dir = interrupted_copy(run, tmp_path / "copy", keep_step=6)
    newest = copy_dir / "checkpoints" / "step-00000006"
    data = sorted(newest.glob("*.distcp"))[0]
    os.truncate(data, 100)
    proc = gpipe("train", str(path), "--output-dir", str(copy_dir), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {newest} is incomplete or corrupt: file {data.name} has 100 bytes" in proc.stderr
    assert "resumed from" in proc.stderr and "step-00000003" in proc.stderr
    assert "moved the checkpoints after step 3 (step-00000006) to" in proc.stderr  # the damaged one, kept aside
    assert "loading the newest whole checkpoint" in proc.stdout  # progress before the load, not silence
    assert "(cut by the checkpoint it resumes)" in proc.stdout  # not measured again: the same cut, exactly
    assert losses(copy_dir) == losses(run)  # exact: same ranks, same data position, RNG and optimizer state


def test_sigterm_leaves_a_complete_checkpoint_and_a_resumable_run(tmp_path):
    path = write(tmp_path, recipe(steps=400, every=1000))
    run = tmp_path / "run"
    proc = _start(path, run)
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler preempting the job: every process gets it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    done = max(losses(run))
    found = run / "checkpoints" / f"step-{done:08d}"
    assert (found / "manifest.json").exists(), (out[-2000:], err[-2000:])
    assert f"stopped by SIGTERM after step {done}" in out
    assert done < 400
    # What is proven is that the run resumes: its ranks may start forked ready, as torchrun's
    resumed = gpipe_train(2, str(path), "--output-dir", str(run), "--resume", "--set", f"train.steps={done + 2}",
                          "--threads", "1")
    assert resumed.codes == [0, 0], resumed.stderr[-3000:]
    assert max(losses(run)) == done + 2


def test_a_second_stop_signal_changes_neither_the_stop_nor_its_exit_code(tmp_path):
    # The stop said SIGHUP, the launcher exited 143: the agent raised again for the SIGTERM that followed.
    path = write(tmp_path, recipe(steps=400, every=1000))
    run = tmp_path / "run"
    proc = _start(path, run)
    os.kill(proc.pid, signal.SIGHUP)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    assert f"stopped by SIGHUP after step {max(losses(run))}" in out


def test_a_closed_terminal_saves_and_stops_the_run_as_sigterm_does(tmp_path):
    path = write(tmp_path, recipe(steps=400, every=1000))
    run = tmp_path / "run"
    proc = _start(path, run)
    os.killpg(proc.pid, signal.SIGHUP)  # a closed terminal window or a dropped ssh session
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    done = max(losses(run))
    assert (run / "checkpoints" / f"step-{done:08d}" / "manifest.json").exists(), (out[-2000:], err[-2000:])
    assert f"stopped by SIGHUP after step {done}; continue with gpipe train --resume" in out


def test_export_writes_the_consolidated_model(full_run, tmp_path, handlers):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from gpipe_cli.cli import run as gpipe_here
    from gpipe_cli.recipe.load import load_recipe
    from gpipe_cli.recipe_model import model_spec

    path, run = full_run
    target = tmp_path / "model.safetensors"
    assert gpipe_here(["export", str(run), "--output", str(target)]) == 0  # in this process: what it writes counts

    tensors = load_file(str(target))
    with safe_open(str(target), "pt") as f:
        tied = json.loads(f.metadata().get("tied", "{}"))  # alias -> the stored tensor it shares
    spec = model_spec(load_recipe(path))
    expected = {f"{i}.{name}" for i, layer in enumerate(spec.build_all()) for name in layer.state_dict()}
    assert set(tensors) | set(tied) == expected and not set(tensors) & set(tied)
    assert all(target_name in tensors for target_name in tied.values())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_in_the_final_evaluation_ends_it_at_once_with_128_plus_the_signal(tmp_path, signum):
    # Once the last step is saved nothing is left to finish: the evaluation stops, unrecorded, and the command
    # ends as any stopped run does (a SIGTERM waited two minutes for the launcher's tear-down; a Ctrl-C exited 0).
    r = recipe(steps=2, every=1000)
    r["data"]["synthetic_size"] = 3000  # about 30 held-out batches, each decoded word by word for BLEU
    r["eval"] = {}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "train", str(write(tmp_path, r)),
                             "--output-dir", str(run), "--plain", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("evaluating the trained model on "):
            break
    time.sleep(0.5)
    os.killpg(proc.pid, signum)
    stopped = time.monotonic()
    out, err = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 128 + signum, err[-3000:]
    assert time.monotonic() - stopped < 60
    name = signal.Signals(signum).name
    assert f"stopped by {name} in the final evaluation; training is done and step 2 saved" in out
    assert (run / "checkpoints" / "step-00000002" / "manifest.json").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert not [r for r in records if r["kind"] == "eval"]  # cut short: nothing recorded as if whole
    assert "Traceback" not in err
    if signum != signal.SIGINT:
        return
    # A resume makes that evaluation, and nothing else: it said "already complete; nothing to do" for good.
    dry = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", "--resume", str(run), "--dry-run"],
                         capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0 and dry.stdout.count(", to make its final evaluation, which a stop cut short") == 1
    resumed = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", "--resume", str(run), "--plain",
                              "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "evaluating step 2 first: the run's records hold no evaluation of it" in resumed.stdout
    assert f"the run in {run} is complete at step 2, its final evaluation recorded" in resumed.stdout
    assert ", to make its final evaluation, which a stop cut short" in resumed.stdout
    assert resumed.stdout.count("final eval: step 2: loss") == 1 and "eval  step" not in resumed.stdout  # once
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_ranks_set_up_is_one_line_and_128_plus_the_signal(tmp_path, signum):
    run = tmp_path / "run"
    slow = recipe(steps=400)
    slow["data"]["synthetic_size"] = 100_000  # the ranks build data and a tokenizer for seconds before step 1
    proc = subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "train", str(write(tmp_path, slow)),
                             "--output-dir", str(run), "--plain", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "reading data" in line:  # a rank said so: the ranks run, and set up
            break
    time.sleep(0.5)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-3000:]
    assert err.count(f"[gpipe] {signal.Signals(signum).name}: stopping now, before the first step is done") == 1, err
    for noise in ("Traceback", "failed", "killed", "W1", "E1"):  # no rank's or torch's report of it
        assert noise not in out + err
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    # Sent 0.05 s after the first, the second Ctrl-C was taken as the first one's echo and the run stopped in order:
    # the test passed without an abort. Rank 1 held stopped keeps the step in flight from ending, however fast, and
    # rank 0 waiting for it: Ctrl-C is answered, and the second aborts, all the same (they waited for the stall
    # timeout's 60 s while rank 0's main thread was held in that wait).
    proc = _start(write(tmp_path, recipe(steps=400, every=1000)), tmp_path / "run")
    ranks = ranks_of(proc.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stderr is not None
        for line in proc.stderr:
            if "SIGINT: stopping after the steps in flight" in line:
                break
        time.sleep(ECHO_S + 0.3)  # past an echo of the first
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the abort's tear-down may have ended it already
            os.kill(ranks[1], signal.SIGCONT)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "[gpipe] SIGINT again: aborted at once" in err and "Traceback" not in err, err[-3000:]
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))


def test_a_closed_output_stops_the_run_with_a_checkpoint_as_a_shell_would(tmp_path):
    # `gpipe train | head` ended with "stage 0 (rank 0) lost contact with another rank: BrokenPipeError", exit 1.
    run, temporary = tmp_path / "run", tmp_path / "tmp"
    temporary.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "train",
                             str(write(tmp_path, recipe(steps=400, every=1000))), "--output-dir", str(run),
                             "--plain", "--threads", "1", "--set", "train.log_every=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(temporary)})
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.stdout.close()  # as `head` does once it has its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err[-3000:]
    done = max(losses(run))
    assert (run / "checkpoints" / f"step-{done:08d}" / "manifest.json").exists()
    assert "[gpipe] the output was closed (SIGPIPE): writing a checkpoint, then stopping" in err
    assert f"[gpipe] stopped by SIGPIPE after step {done}; continue with gpipe train --resume" in err
    for noise in ("Traceback", "lost contact", "exited with code"):
        assert noise not in err
    # The launch's own folders are gone (torch's agent left a torchelastic_* folder behind every launch).
    assert not [p.name for p in temporary.iterdir() if p.name.startswith(("torchelastic_", "gpipe-launch-"))]


def _stop_before_the_first_step(args: list[str], written: Path | None = None) -> None:
    """Start `gpipe train *args` and Ctrl-C its process group once its set-up is written, before its first step."""
    proc = subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "train", *args, "--plain", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        # "[ 9.1 s] training NAME: steps ...": the set-up is done, step 1 under way; with `written` (a new run's
        # folder), sooner: at "building 2 stages", once its recipe and records are there too.
        if f"] {'building' if written else 'training'} " in line:
            break
    # On a busy machine a Ctrl-C sent at "training NAME" once came after two steps of 0.3 s.
    deadline = time.monotonic() + 120
    while written and not all((written / name).exists() for name in ("recipe.yaml", "metrics.jsonl")):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "[gpipe] SIGINT: stopping now, before the first step is done" in err, "".join(lines) + out + err


def test_a_stop_before_the_first_step_in_a_folder_the_user_made_takes_out_only_what_the_run_added(tmp_path):
    # The run's recipe.yaml, empty records, checkpoints/ and tokenizer stayed in an --output-dir made beforehand.
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    # Steps of a larger batch: the Ctrl-C has their time to land before the first one ends.
    slow = recipe(steps=400)
    slow["data"] = {**slow["data"], "batch_size": 40, "synthetic_size": 800}
    _stop_before_the_first_step([str(write(tmp_path, slow)), "--output-dir", str(run)], run)
    assert os.listdir(run) == ["notes.txt"] and (run / "notes.txt").read_text() == "mine"


def test_a_resume_stopped_before_its_first_step_leaves_the_runs_recipe_as_it_was(full_run, tmp_path):
    # Its --set was recorded all the same: a later plain `--resume` trained with it, and `gpipe report` read it.
    _, run = full_run
    copy_dir = Path(shutil.copytree(run, tmp_path / "copy"))
    before = (copy_dir / "recipe.yaml").read_bytes()
    _stop_before_the_first_step(["--resume", str(copy_dir), "--set", "train.steps=20", "--set", "optimizer.lr=0.01"])
    assert (copy_dir / "recipe.yaml").read_bytes() == before
    assert max(losses(copy_dir)) == 8 and not (copy_dir / "checkpoints" / "step-00000009").exists()
