"""Faults done to real ranks: a killed or stopped rank, a full disk, damaged checkpoints.

Each asserts the exit code, how many lines the error takes, no traceback, and nothing left behind.
"""

import copy
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from tests.train.as_ranks import gpipe_train, ranks_of
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow


def recipe(steps: int, every: int = 1000, **train: object) -> dict:
    r = copy.deepcopy(TINY_TRANSLATION)
    r["train"].update(steps=steps, **train)
    r["checkpoint"] = {"every": every, "keep": 5}
    r["eval"] = {}
    return r


def command(path: Path, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpipe_cli.cli", "train", str(path), "--output-dir", str(run), "--plain",
            "--threads", "1", *extra]


def gpipe(path: Path, run: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(path, run, *extra), capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def error_lines(stderr: str) -> list[str]:
    """What the user reads as the error: every line but the progress lines of the plain view."""
    return [line for line in stderr.splitlines() if line.strip()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(path: Path, run: Path, steps_seen: int = 2) -> tuple[subprocess.Popen, dict[int, int]]:
    """Start a run and return once it trained `steps_seen` steps, with its ranks' pids."""
    proc = subprocess.Popen(command(path, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps_seen:
            return proc, ranks_of(proc.pid)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("the run did not start")


def finish(proc: subprocess.Popen, pids: dict[int, int], timeout: float) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    assert not [pid for pid in pids.values() if alive(pid)], "orphan ranks left behind"
    return out, err, elapsed


def test_a_killed_rank_is_named_with_its_signal_and_the_job_ends(tmp_path):
    proc, pids = start(write(tmp_path, recipe(steps=10_000)), tmp_path / "run")
    assert set(pids) == {0, 1}
    os.kill(pids[1], signal.SIGKILL)
    out, err, elapsed = finish(proc, pids, timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "Traceback" not in err
    assert error_lines(err) == ["gpipe: rank 1 (stage 1) was killed by SIGKILL"], err[-3000:]
    assert "checkpoint" not in out + err  # tear-down announces nothing it does not do
    assert elapsed < 30


def test_a_stopped_rank_is_named_within_the_stall_timeout(tmp_path):
    proc, pids = start(write(tmp_path, recipe(steps=10_000, stall_timeout=10)), tmp_path / "run")
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    out, err, _ = finish(proc, pids, timeout=90)
    elapsed = time.monotonic() - stopped
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err
    lines = error_lines(err)
    assert len(lines) == 1 and "rank 1 (stage 1) stopped responding: no heartbeat for 10 s" in lines[0], err[-3000:]
    assert 10 <= elapsed < 60


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


def leftovers(run: Path) -> list[str]:
    return [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """10 steps, a checkpoint every 2, the disk full at step 8: (recipe, run, process).

    Checkpoints 2, 4 and 6 are whole; the damaged-checkpoint test damages copies of them.
    """
    folder = tmp_path_factory.mktemp("full-disk")
    path, run = write(folder, recipe(steps=10, every=2)), folder / "run"
    return path, run, gpipe(path, run, env={"GPIPE_TEST_CHECKPOINT_FAULT": "enospc@8"})


def test_a_full_disk_during_a_checkpoint_stops_the_run_in_one_line(full_disk):
    _, run, proc = full_disk
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "cannot write checkpoint step-00000008 (ENOSPC: No space left on device)" in lines[0]
    assert " free on " in lines[0]
    assert leftovers(run) == [], "the partial folder is removed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-0000000{s}" for s in (2, 4, 6)]
    assert max(losses(run)) == 8, "the run stopped at the failed checkpoint"


def flip(file: Path, count: int = 512) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2 - count // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    file.write_bytes(bytes(data))


def unsafe_metadata(folder: Path) -> None:
    """Metadata that names something no checkpoint holds, with a manifest that vouches for it."""
    bad = pickle.dumps(print)
    (folder / ".metadata").write_bytes(bad)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][".metadata"] = len(bad)
    manifest["checksums"][".metadata"] = xxhash.xxh3_64(bad).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_damaged_checkpoints_fall_back_one_line_each_on_every_rank(full_disk, tmp_path):
    path, finished, _ = full_disk
    assert sorted(p.name for p in (finished / "checkpoints").iterdir())[-1] == "step-00000006"
    run = shutil.copytree(finished, tmp_path / "run")
    reference = losses(run)
    checkpoints = run / "checkpoints"
    flip(sorted((checkpoints / "step-00000006").glob("*.distcp"))[-1])  # caught by its checksum
    unsafe_metadata(checkpoints / "step-00000004")  # passes its checksum, refused when loaded
    # Its 2 ranks forked ready, as torchrun's: what counts is what each rank reads and says
    proc = gpipe_train(2, str(path), "--output-dir", str(run), "--threads", "1", "--resume", "--set", "train.steps=3")
    assert proc.codes == [0, 0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 4, proc.stderr[-3000:]
    assert "step-00000006 is incomplete or corrupt: file" in lines[0] and "does not match its checksum" in lines[0]
    assert "step-00000004 is incomplete or corrupt:" in lines[1]
    assert "builtins.print, which a checkpoint never holds" in lines[1]
    assert lines[2].endswith("step-00000002 (step 2)") and "resumed from" in lines[2]
    # The damaged ones go out of the next resume's way, kept.
    assert "moved the checkpoints after step 2 (step-00000004, step-00000006) to" in lines[3]
    assert losses(run)[3] == reference[3]


def train_steps(run: Path) -> list[int]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in records if r["kind"] == "train"]  # a step recorded twice shows twice


def test_a_resume_of_a_course_set_aside_takes_back_its_records_and_sets_the_other_aside(full_disk, tmp_path):
    path, finished, _ = full_disk
    run = shutil.copytree(finished, tmp_path / "run")
    checkpoints = run / "checkpoints"
    first = gpipe_train(2, str(path), "--output-dir", str(run), "--threads", "1", "--set", "train.steps=6",
                        "--resume", str(checkpoints / "step-00000002"))
    assert first.codes == [0, 0], first.stderr[-3000:]
    # A checkpoint named is the one loaded: not "the newest whole checkpoint of" it.
    assert f"loading checkpoint {checkpoints / 'step-00000002'}" in first.stdout + first.stderr
    (old,) = checkpoints.glob("superseded-*-at-step-2")
    assert train_steps(old) == [3, 4, 5, 6, 7, 8] and train_steps(run) == [1, 2, 3, 4, 5, 6]
    # Back to the course the first resume left, from its step 6: the course trained since goes aside in turn.
    second = gpipe_train(2, str(path), "--output-dir", str(run), "--threads", "1", "--set", "train.steps=8",
                         "--resume", str(old / "step-00000006"))
    assert second.codes == [0, 0], second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    (new,) = set(checkpoints.glob("superseded-*-at-step-2*")) - {old}
    assert sorted(p.name for p in new.iterdir()) == ["metrics.jsonl", "step-00000004", "step-00000006"]
    assert train_steps(new) == [3, 4, 5, 6]
    assert train_steps(run) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000008"]
