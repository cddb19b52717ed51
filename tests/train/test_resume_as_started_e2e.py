"""A run stopped early continues as it was started, through `gpipe train` on CPU, as a new user types it:
`gpipe train --set train.steps=N`, Ctrl-C, then the command the stop names, `gpipe train --resume RUN`,
trains to N (not to the built-in recipe's 200 steps); a `--set` on the resume is said before the first
step and applied. Every step's figures add up: the first after a timed cut, the first after a resume and
the steady ones."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpipe_cli.pipeline.stats import PARTS
from tests.interrupt import as_from_a_terminal

pytestmark = pytest.mark.slow

STEPS = 16  # the built-in recipe trains 200


def gpipe(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args, "--plain", "--threads", "1"], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def train_records(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def copy_of(cwd: Path, target: Path) -> Path:
    """The folder the stopped run was started in, copied (the run's path in it, relative, is the same)."""
    shutil.copytree(cwd / "outputs", target / "outputs")
    return target


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, Path, int, str]:
    """The quick start with `--set train.steps=16` at M=8, its cut timed first (nothing cached), stopped by
    Ctrl-C after a few steps: (the folder it ran in, the run it names, the step it stopped after, its output)."""
    cwd = tmp_path_factory.mktemp("as-started")
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cwd.parent / f"{cwd.name}-costs")}  # an empty cache: timed
    proc = subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "train", "--set", f"train.steps={STEPS}",
                             "--set", "pipeline.microbatches=8", "--set", "eval.batches=1", "--plain",
                             "--threads", "1"], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = list(cwd.glob("outputs/quickstart/*/metrics.jsonl"))
        if metrics and len(metrics[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher's process group
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, (out[-3000:], err[-3000:])
    assert "timing each layer" in out  # the cut was timed before the first step
    found = re.search(r"^stopped by SIGINT after step (\d+); continue with gpipe train --resume (\S+)$", out, re.M)
    assert found, out[-3000:]
    done = int(found[1])
    assert 0 < done < STEPS
    return cwd, Path(found[2]), done, out


def test_the_stop_names_the_run_to_continue(stopped):
    cwd, run, done, _ = stopped
    assert not run.is_absolute() and run.parent == Path("outputs/quickstart")  # as typed, from where it ran
    assert (cwd / run / "checkpoints" / f"step-{done:08d}" / "manifest.json").exists()
    # Ctrl-C finishes the step in flight and saves it: the checkpoint is of the last step trained.
    records = [json.loads(line) for line in (cwd / run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if r["kind"] == "train") == done


def test_resuming_with_only_the_run_trains_to_its_own_steps_and_every_step_adds_up(stopped, tmp_path):
    cwd, run, done, _ = stopped
    here = copy_of(cwd, tmp_path)
    proc = gpipe(here, "train", "--resume", str(run))  # exactly what the stop said
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming {run} at step {done} with the run's own settings ({run}/recipe.yaml)\n" in proc.stdout
    assert "differ" not in proc.stdout and f"{STEPS} steps" in proc.stdout.splitlines()[0]
    assert f"summary: steps {done + 1}-{STEPS} of {STEPS}, since the resume," in proc.stdout
    records = train_records(here / run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # to 16, not the recipe's 200
    saved = yaml.safe_load((here / run / "recipe.yaml").read_text())
    assert saved["train"]["steps"] == STEPS and saved["pipeline"]["microbatches"] == 8

    # The first step after the timed cut, the first after the resume, and the steady ones all add up.
    assert [r["step"] for r in records if r.get("warmup")] == [1, done + 1]
    assert [r["step"] for r in records if r.get("resumed")] == [done + 1]
    for record in records:
        seconds = record["step_time_s"]
        for stage in range(2):
            parts = [record["time_s"][part][stage] for part in PARTS]
            assert min(parts) >= 0 and sum(parts) == pytest.approx(seconds, rel=1e-9), record
        assert 0.0 <= record["bubble"] <= 1.0 and 0.0 <= record["idle"] <= 1.0, record
        assert record["samples_per_s"] == pytest.approx(32 / seconds)


def test_a_set_on_the_resume_is_said_before_the_first_step_and_applied(stopped, tmp_path):
    cwd, run, done, _ = stopped
    here = copy_of(cwd, tmp_path)
    steps = done + 3
    proc = gpipe(here, "train", "--resume", str(run), "--set", f"train.steps={steps}", "--set", "train.log_every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    said = f"resuming {run} at step {done} with train.log_every 20 -> 1, train.steps {STEPS} -> {steps} (--set)"
    assert said in lines, proc.stdout[-3000:]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert lines.index(said) < first_step
    assert [r["step"] for r in train_records(here / run)][-1] == steps
    assert yaml.safe_load((here / run / "recipe.yaml").read_text())["train"]["steps"] == steps
