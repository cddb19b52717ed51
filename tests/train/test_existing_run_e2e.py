"""What the ranks do with an existing run: the end set by train.epochs, the recipe recorded only once a
resume goes on, a save cut short removed; through `gpipe train` on CPU."""

import copy
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow


def gpipe(path: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", str(path), "--output-dir", str(run),
                           "--plain", "--threads", "1", *extra], capture_output=True, text=True, timeout=300)


def ranks(path: Path, run: Path, *extra: str):
    """The same on its 2 ranks forked ready, as torchrun's: where what counts is what the ranks do and say."""
    return gpipe_train(2, str(path), "--output-dir", str(run), "--threads", "1", *extra)


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """4 steps of the tiny translation model, a checkpoint every 2: (recipe, run)."""
    folder = tmp_path_factory.mktemp("existing")
    recipe = copy.deepcopy(TINY_TRANSLATION)
    recipe["train"]["steps"] = 4
    recipe["checkpoint"] = {"every": 2, "keep": 5}
    recipe["eval"] = {}
    path, run = write(folder, recipe), folder / "run"
    proc = ranks(path, run)
    assert proc.codes == [0, 0], proc.stderr[-3000:]
    return path, run


def test_a_resume_removes_a_save_cut_short_records_its_settings_and_a_second_one_does_nothing(finished, tmp_path):
    path, original = finished
    run = shutil.copytree(original, tmp_path / "run")
    stale = run / "checkpoints" / ".step-00000005.partial"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\0" * 4096)
    proc = ranks(path, run, "--resume", "--set", "train.steps=6")
    assert proc.codes == [0, 0], proc.stderr[-3000:]
    assert (f"resuming {run} at step 4 with {path} and --set, which differ from the run's recipe.yaml: "
            f"train.steps 4 -> 6") in proc.stdout
    assert f"removed {stale}, a checkpoint whose save never finished" in proc.stdout
    assert not stale.exists()
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["steps"] == 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-0000000{s}" for s in (2, 4, 6)]

    before = hashes(run)
    again = gpipe(path, run, "--resume", "--set", "train.steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the run in {run} is already complete at step 6 (train.steps 6)" in again.stdout
    assert "starting" not in again.stdout and again.stderr == ""
    assert hashes(run) == before


def test_with_train_epochs_the_ranks_refuse_a_checkpoint_past_the_end_and_write_nothing(finished, tmp_path):
    path, original = finished
    run = shutil.copytree(original, tmp_path / "run")
    before = hashes(run)
    # 200 training examples in batches of 100: two steps per epoch, so the run ends at step 2
    proc = ranks(path, run, "--resume", "--set", "train.steps=null", "--set", "train.epochs=1",
                 "--set", "data.batch_size=100")
    assert 2 in proc.codes, proc.stderr[-3000:]  # a rank refused: the launcher would exit 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("checkpoint step-00000004 is at step 4, past the 2 steps of train.epochs 1; resuming would write "
            "earlier steps over it; raise train.epochs to train past step 4") in lines[0]
    assert hashes(run) == before


def test_with_train_epochs_a_run_at_its_end_is_complete_and_untouched(finished, tmp_path):
    path, original = finished
    run = shutil.copytree(original, tmp_path / "run")
    before = hashes(run)
    # batches of 50: 4 steps per epoch, so one epoch ends at the checkpoint's step 4
    proc = ranks(path, run, "--resume", "--set", "train.steps=null", "--set", "train.epochs=1",
                 "--set", "data.batch_size=50")
    assert proc.codes == [0, 0], proc.stderr[-3000:]
    assert (f"the run in {run} is already complete at step 4 (the 4 steps of train.epochs 1); nothing to do "
            f"(raise train.epochs to train past step 4)") in proc.stdout
    assert "training tiny-translation" not in proc.stdout and "eval" not in proc.stdout and proc.stderr == ""
    assert hashes(run) == before
