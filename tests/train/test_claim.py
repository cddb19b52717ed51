"""A run directory is held by the one `gpipe train` writing it: a second launch into it is refused in one line,
before any rank starts, and a launch that ends, however it ends, leaves no claim behind."""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpipe_cli.cli import app
from gpipe_cli.errors import UserError
from gpipe_cli.launch import LaunchOptions
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.runs import run_dir_of
from gpipe_cli.train import claim
from gpipe_cli.train import run as run_module
from gpipe_cli.train.existing import choose_run_dir
from gpipe_cli.train.run import claimed_elsewhere, claims
from tests.train import recipes
from tests.train.test_existing_run import error_line, hashes, make_run

runner = CliRunner()


@pytest.fixture
def launches(monkeypatch):
    """Start no rank: record each launch's job and what its run directory held while the ranks would run."""
    seen: list[dict] = []

    def launch(module, args, *rest, **kwargs):
        job = json.loads(Path(args[0]).read_text())
        where = Path(job["run_dir"] or job["output_dir"] or run_dir_of(job["resume"]))
        lock = where / claim.LOCK
        job["held_by"] = lock.read_text().split()[0] if lock.is_file() else None
        seen.append(job)
        return 0

    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    return seen


def train(*args: str):
    return runner.invoke(app, ["train", "--plain", *args])


# ----------------------------------------------------------------- the claim itself

def test_a_claim_makes_the_directory_names_its_process_and_leaves_nothing_once_it_ends(tmp_path):
    run = tmp_path / "new" / "run"
    with claim.held(run, "--output-dir", "wait") as made:
        assert made and (run / claim.LOCK).read_text().split()[0] == str(os.getpid())
    assert not run.exists()  # nothing was written: a run that never started leaves nothing behind
    assert not run.parent.exists()  # nor the folder made above it
    run.mkdir(parents=True)
    with claim.held(run, "--output-dir", "wait") as made:
        assert not made
        (run / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # the lock file goes, the run stays


def test_a_full_disk_still_holds_the_claim_and_leaves_nothing_behind(tmp_path, monkeypatch):
    # The line naming the holder could not be written: a traceback, and the directory and its lock left behind.
    import errno

    def full(fd, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(claim.os, "ftruncate", full)
    run = tmp_path / "run"
    with claim.held(run, "--output-dir", "wait") as made:
        assert made and (run / claim.LOCK).exists()
    assert not run.exists()


@pytest.mark.parametrize("then, stays", [
    ({}, False),
    ({"metrics.jsonl": '{"kind": "train", "step": 1}\n'}, True),  # a step was recorded: a run, kept
    ({"notes.txt": "mine"}, True),  # something the run does not write: never removed
    ({"checkpoints/step-00000001/.metadata": ""}, True),
    ({"checkpoints/.writing/part": ""}, True),  # a checkpoint cut short: nothing removed, not half the set-up
])
def test_a_run_stopped_before_its_first_step_leaves_no_set_up_behind(tmp_path, monkeypatch, then, stays):
    """A Ctrl-C between the run's set-up and its first step left a folder that `gpipe report outputs/x/*` refused."""
    listed = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: sorted(listed(path), key=lambda name: name == "checkpoints"))
    run = tmp_path / "run"
    with claim.held(run, "the output directory", "wait", made=True):
        for name, text in {"recipe.yaml": "name: x\n", "tokenizer.model": "", "metrics.jsonl": "", **then}.items():
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).write_text(text)
        (run / "checkpoints").mkdir(exist_ok=True)
    assert run.exists() == stays and (not stays or (run / "recipe.yaml").is_file())
    run.mkdir(exist_ok=True)
    (run / "recipe.yaml").write_text("name: x\n")
    with claim.held(run, "--output-dir", "wait"):  # a folder the user gave, there before: kept as it is
        pass
    assert (run / "recipe.yaml").is_file()


def test_a_run_directory_its_rank_took_out_takes_the_folders_made_above_it_along(tmp_path):
    """Stopped while building its stage, rank 0 removed the run directory: `outputs/NAME/` stayed, empty."""
    name = tmp_path / "outputs" / "name"
    run = name / "20261205-120000"
    (tmp_path / "outputs" / "other").mkdir(parents=True)  # there before: stays, and so does outputs/
    with claim.held(run, "the output directory", "wait", made=True, parents=[run, name, name.parent]):
        (run / "recipe.yaml").write_text("name: x\n")
        shutil.rmtree(run)
    assert not name.exists() and (tmp_path / "outputs" / "other").is_dir()


@pytest.mark.parametrize("mine, recorded", [({}, False), ({"notes.txt": "mine"}, False), ({"notes.txt": "mine"}, True)])
def test_a_run_stopped_before_its_first_step_in_a_folder_made_beforehand_takes_out_only_its_own(
        tmp_path, monkeypatch, mine, recorded):
    """Its recipe.yaml, empty records, checkpoints/ and tokenizer stayed in an --output-dir the user had made."""
    out = tmp_path / "out"
    out.mkdir()
    for name, text in mine.items():
        (out / name).write_text(text)

    def launch(module, args, *rest, **kwargs):  # the ranks set up, and a Ctrl-C comes before (or after) step 1
        for name, text in {"recipe.yaml": "name: x\n", "tokenizer.model": "", "metrics.jsonl": ""}.items():
            (out / name).write_text(text)
        (out / "checkpoints").mkdir()
        if recorded:
            (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
        return 128 + signal.SIGINT

    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    result = train(str(recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))), "--output-dir", str(out))
    assert result.exit_code == 128 + signal.SIGINT, result.output
    left = {"checkpoints", "metrics.jsonl", "recipe.yaml", "tokenizer.model"} if recorded else set()
    assert set(os.listdir(out)) == left | set(mine)
    assert all((out / name).read_text() == text for name, text in mine.items())


def test_a_second_claim_is_refused_in_one_line_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with claim.held(run, "--output-dir", "wait until it ends"):
        with pytest.raises(UserError) as caught, claim.held(run, "--output-dir", "wait until it ends"):
            pytest.fail("claimed twice")
        assert str(caught.value) == (f"--output-dir: {run} is being written by another gpipe train "
                                     f"(pid {os.getpid()}); wait until it ends")
    with claim.held(run, "--output-dir", "wait") as made:  # free again once the first has ended
        assert made


def test_a_holder_on_another_host_is_named_with_it(tmp_path):
    run = tmp_path / "run"
    with claim.held(run, "--output-dir", "wait"):
        (run / claim.LOCK).write_text("4321 node-17\n")
        with pytest.raises(UserError, match=r"another gpipe train \(pid 4321 on node-17\); wait$"), \
                claim.held(run, "--output-dir", "wait"):
            pass


def test_a_claim_ends_with_its_process_however_it_ends(tmp_path):
    # A flock dies with the process: a launch killed outright never leaves a claim that refuses a retry.
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from gpipe_cli.train.claim import held\n"
                               "with held(Path(sys.argv[1]), '--output-dir', 'wait'):\n"
                               "    print('held', flush=True); time.sleep(60)", str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(UserError, match=f"pid {holder.pid}"), claim.held(run, "--output-dir", "wait"):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / claim.LOCK).exists()  # left by the killed process, and no obstacle
    with claim.held(run, "--output-dir", "wait") as made:
        assert not made and (run / claim.LOCK).read_text().split()[0] == str(os.getpid())


@pytest.mark.parametrize("made", [True, False])
def test_a_stop_that_ends_the_process_at_once_takes_its_claim_and_set_up_along(tmp_path, made):
    # Under torchrun, rank 0 stopped while it waited inside torch for its peers ended 2 s later without unwinding:
    # the run directory made for it was left holding only the lock file.
    run = tmp_path / "outputs" / "name" / "run"
    if not made:
        (run / "checkpoints" / "step-00000002").mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    script = ("import sys; from pathlib import Path; from gpipe_cli.train.claim import held\n"
              "from gpipe_cli.pipeline.stopping import abrupt_exit\n"
              "with held(Path(sys.argv[1]), '--output-dir', 'wait', made=not Path(sys.argv[1]).exists()):\n"
              "    (Path(sys.argv[1]) / 'recipe.yaml').write_text('name: x')\n"
              "    abrupt_exit(130)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (130, "")
    if made:
        assert not (tmp_path / "outputs").exists()  # and the folders made above it
    else:  # a run's own: kept whole, less the claim
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl", "recipe.yaml"]


def test_runs_started_in_the_same_second_each_get_a_directory_of_their_own(tmp_path, monkeypatch):
    class Clock:  # every launch in the same second
        class datetime:  # noqa: N801 (stands in for the module's datetime.datetime)
            @staticmethod
            def now() -> datetime.datetime:
                return datetime.datetime(2026, 12, 2, 9, 30, 0)

    monkeypatch.setattr("gpipe_cli.train.existing.datetime", Clock)
    recipe = load_recipe(recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION)))
    made = [choose_run_dir(recipe, None, str(tmp_path / "outputs"), make=True) for _ in range(3)]
    assert [p.name for p in made] == ["20261202-093000", "20261202-093000-1", "20261202-093000-2"]
    assert all(p.is_dir() for p in made)


def test_one_process_of_a_job_claims(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert claims(LaunchOptions(), 2)  # the job's one launcher
    assert claims(LaunchOptions(nnodes="2", node_rank=0, rdzv_endpoint="h:29500"), 4)
    assert not claims(LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint="h:29500"), 4)
    assert not claims(LaunchOptions(nnodes="2", rdzv_backend="c10d", rdzv_endpoint="h:29500"), 4)  # rank 0's node?
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert not claims(LaunchOptions(), 2)  # under torchrun every rank runs the command: rank 0 claims
    monkeypatch.setenv("RANK", "0")
    assert claims(LaunchOptions(), 2)


# ----------------------------------------------------------------- gpipe train

def test_a_second_train_into_a_directory_being_written_is_refused_before_any_rank_starts(tmp_path, launches):
    # Two launches seconds apart both passed the checks and wrote one metrics.jsonl, records interleaved.
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    out = tmp_path / "out"
    with claim.held(out, "--output-dir", "wait"):  # the first launch, its ranks still setting up
        result = train(str(path), "--output-dir", str(out))
        assert result.exit_code == 2, result.output
        assert error_line(result) == (f"error: --output-dir: {out} is being written by another gpipe train "
                                      f"(pid {os.getpid()}); wait until it ends, or give another --output-dir")
        assert not launches and [p.name for p in out.iterdir()] == [claim.LOCK]
    result = train(str(path), "--output-dir", str(out))  # once it has ended
    assert result.exit_code == 0, result.output
    assert launches[0]["run_dir"] == str(out) and launches[0]["held_by"] == str(os.getpid())
    assert not out.exists()  # the stand-in ranks wrote nothing: the directory made for them goes


def test_a_resume_of_a_run_being_written_is_refused_and_the_run_kept(tmp_path, launches):
    path, run = make_run(tmp_path, steps=(4,))
    with claim.held(run, "--output-dir", "wait"):
        before = hashes(run)
        for args in (["--resume", str(run)], [str(path), "--output-dir", str(run), "--resume", "latest"]):
            result = train(*args, "--set", "train.steps=8")
            assert result.exit_code == 2, result.output
            flag = "--resume" if "--output-dir" not in args else "--output-dir"
            assert error_line(result).startswith(f"error: {flag}: {run} is being written by another gpipe train "
                                                 f"(pid {os.getpid()}); wait until it ends")
        assert hashes(run) == before and not launches
    result = train("--resume", str(run), "--set", "train.steps=8")
    assert result.exit_code == 0, result.output
    assert launches[0]["run_dir"] is None and launches[0]["resume"] == str(run) and launches[0]["held_by"] == \
        str(os.getpid())
    assert claim.LOCK not in os.listdir(run)


@pytest.mark.parametrize("bare", [False, True])
def test_under_torchrun_the_other_ranks_resume_the_run_their_rank_0_has_claimed(tmp_path, monkeypatch, bare):
    # Rank 1, slower to its checks than rank 0 to its claim, refused the run as another gpipe train's; silent (its
    # node's rank 0 speaks), it left rank 0 waiting for it in the job.
    path, run = make_run(tmp_path, steps=(4,))
    joined: list[int] = []
    monkeypatch.setattr("gpipe_cli.train.worker.run_job", lambda job: joined.append(1) or 0)
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    args = (str(path), "--output-dir", str(run), "--resume", "latest") if bare else ("--resume", str(run))
    with claim.held(run, "--output-dir", "wait"):  # rank 0's claim, or another job's: rank 1 cannot tell them apart
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        result = train(*args, "--set", "train.steps=8")
        assert result.exit_code == 0, result.output
        assert joined == [1]
        monkeypatch.setenv("RANK", "0")  # the claimant: another job's claim refuses it, and so the whole job
        monkeypatch.setenv("LOCAL_RANK", "0")
        result = train(*args, "--set", "train.steps=8")
        assert result.exit_code == 2, result.output
        assert "is being written by another gpipe train" in error_line(result) and joined == [1]


def test_a_node_of_a_c10d_job_still_refuses_a_run_another_job_writes(tmp_path, launches):
    # With c10d no launcher claims the run (none knows it starts rank 0): a holder can only be another job's.
    path, run = make_run(tmp_path, steps=(4,))
    assert not claimed_elsewhere(LaunchOptions(nnodes="2", rdzv_backend="c10d", rdzv_endpoint="h:29500"), 4)
    assert claimed_elsewhere(LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint="h:29500"), 4)
    with claim.held(run, "--output-dir", "wait"):
        result = train("--resume", str(run), "--set", "train.steps=8", "--nnodes", "2", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", "127.0.0.1:29500")
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith(f"error: --resume: {run} is being written by another gpipe train")
    assert not launches


def test_a_new_run_into_a_run_being_written_says_so_rather_than_advise_a_resume(tmp_path, launches):
    # It said "already holds a run; use --resume to continue it", and that resume was then refused.
    path, run = make_run(tmp_path, steps=(4,))
    assert claim.writer_of(run) is None
    with claim.held(run, "--output-dir", "wait"):
        assert claim.writer_of(run) == f"pid {os.getpid()}"
        result = train(str(path), "--output-dir", str(run))
        assert result.exit_code == 2, result.output
        assert error_line(result) == (f"error: --output-dir: {run} is being written by another gpipe train "
                                      f"(pid {os.getpid()}); wait until it ends, or give another --output-dir")
    assert claim.writer_of(run) is None and not launches
    assert "already holds a run (its last step is 4); use --resume" in error_line(train(str(path), "--output-dir",
                                                                                        str(run)))


def test_a_run_another_launch_finished_while_this_one_was_stopped_is_not_blamed_on_this_one(tmp_path, monkeypatch,
                                                                                           launches):
    # Stopped after its first checks and before its claim, it named its own pid as the run's writer.
    path, done = make_run(tmp_path, steps=(4,))
    out = tmp_path / "out"
    real = run_module._claim

    def finished_meanwhile(*args, **kwargs):
        shutil.copytree(done, out)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "_claim", finished_meanwhile)
    result = train(str(path), "--output-dir", str(out))
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --output-dir {out} already holds a run (its last step is 4); use --resume "
                                  f"to continue it, or another --output-dir for a new run")
    assert not launches and claim.LOCK not in os.listdir(out)


def test_a_new_run_in_the_default_place_is_made_and_held_by_its_launch(tmp_path, monkeypatch, launches):
    monkeypatch.chdir(tmp_path)
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    assert train(str(path)).exit_code == 0
    made = Path(launches[0]["run_dir"])
    assert made.parent == Path("outputs", "tiny-translation") and launches[0]["held_by"] == str(os.getpid())
    assert not made.exists() and not Path("outputs").exists()  # made for the run, and nothing else in them
    Path("outputs", "mine").mkdir(parents=True)  # a folder that holds anything else stays, and what was there
    assert train(str(path)).exit_code == 0
    assert os.listdir("outputs") == ["mine"]


@pytest.mark.parametrize("bare", [False, True])
def test_a_dry_run_of_a_resume_of_a_run_being_written_says_a_launch_would_be_refused(tmp_path, launches, bare):
    # It said the run had no usable checkpoint and advised starting it again from step 0; with a bare --resume
    # into --output-dir RUN it printed the launch and nothing else.
    path, run = make_run(tmp_path, steps=(4,))
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # the writer has not saved its first yet
    args = (str(path), "--output-dir", str(run), "--resume", "latest") if bare else ("--resume", str(run))
    with claim.held(run, "--output-dir", "wait"):
        result = train(*args, "--dry-run")
    assert result.exit_code == 2, result.output
    flag, instead = ("--output-dir", "; wait until it ends, or give another --output-dir") if bare else \
        ("--resume", "; wait until it ends")
    assert error_line(result) == (f"error: {flag}: {run} is being written by another gpipe train "
                                  f"(pid {os.getpid()}){instead}")
    assert not launches


def test_a_dry_run_of_a_bare_resume_of_a_run_without_a_checkpoint_says_it_starts_again(tmp_path, launches):
    # It printed the launch alone: the launch starts the run from step 0 and drops the steps it recorded.
    path, run = make_run(tmp_path, steps=(4,))
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    records = (run / "metrics.jsonl").read_text()
    result = train(str(path), "--output-dir", str(run), "--resume", "latest", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"--resume: '{run}' holds no checkpoint yet; the run starts there again from step 0 (the steps it " \
           f"recorded are dropped)" in result.output
    assert (run / "metrics.jsonl").read_text() == records and not launches  # a dry run changes nothing


def test_a_dry_run_claims_nothing_and_says_a_launch_into_a_held_folder_would_be_refused(tmp_path, launches):
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    out = tmp_path / "out"
    result = train(str(path), "--output-dir", str(out), "--dry-run")
    assert result.exit_code == 0, result.output
    assert not launches and not out.exists()
    # Held by another launch that has written nothing yet: the dry run passed, and the launch was then refused.
    with claim.held(out, "--output-dir", "wait"):
        result = train(str(path), "--output-dir", str(out), "--dry-run")
        assert result.exit_code == 2, result.output
        assert error_line(result) == (f"error: --output-dir: {out} is being written by another gpipe train "
                                      f"(pid {os.getpid()}); wait until it ends, or give another --output-dir")
        assert [p.name for p in out.iterdir()] == [claim.LOCK]  # the holder's claim alone
    assert not launches and not out.exists()


def test_the_command_refuses_a_directory_another_process_holds_in_one_line(tmp_path):
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    out = tmp_path / "out"
    with claim.held(out, "--output-dir", "wait"):
        proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", str(path), "--output-dir", str(out),
                               "--plain"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: --output-dir: {out} is being written by another gpipe train (pid {os.getpid()}); "
                           "wait until it ends, or give another --output-dir\n")
    assert "starting" not in proc.stdout and not out.exists()


def test_a_rank_that_fails_removes_its_lock_file_before_it_ends(tmp_path, monkeypatch):
    # Under torchrun rank 0 holds the claim itself, and a failed rank exits without unwinding.
    from gpipe_cli.pipeline import stopping

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(stopping.os, "_exit", lambda code: None)  # this process goes on
    with claim.held(run, "--output-dir", "wait"):
        stopping.abrupt_exit(1)
        assert os.listdir(run) == []
    assert os.listdir(run) == []


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_ctrl_c_once_the_run_wrote_says_where_it_is_kept(tmp_path, monkeypatch, capsys, checkpoint):
    # A second Ctrl-C while the ranks ended said "nothing was written" of a run with its checkpoint and records.
    from gpipe_cli.cli import run

    run_dir = tmp_path / "run"

    def launch(module, args, *rest, **kwargs):
        (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
        if checkpoint:
            (run_dir / "checkpoints" / "step-00000001").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    recipe = recipes.write(tmp_path, recipes.TINY_AMOEBANET)
    assert run(["train", str(recipe), "--plain", "--output-dir", str(run_dir)]) == 130
    on = f"; continue with gpipe train --resume {run_dir}" if checkpoint else ""
    assert capsys.readouterr().err == f"gpipe train: interrupted; {run_dir} keeps what the run wrote{on}\n"


def test_a_node_stopped_while_it_waits_for_node_0_says_it_wrote_nothing(tmp_path, monkeypatch, capsys):
    # Node 1 of a resume, stopped before node 0 answered, said the run kept what it wrote and to resume it.
    from gpipe_cli.cli import run
    from gpipe_cli.launch import launcher

    def waiting(rdzv, said):
        raise KeyboardInterrupt

    path, run_dir = make_run(tmp_path, steps=(4,))
    monkeypatch.setattr(launcher, "reach", waiting)
    code = run(["train", "--plain", "--resume", str(run_dir), "--set", "train.steps=8", "--nnodes", "2",
                "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1"])
    assert code == 130
    assert capsys.readouterr().err.splitlines()[-1] == "gpipe train: interrupted; nothing was written"
    assert claim.LOCK not in os.listdir(run_dir)


@pytest.mark.parametrize("when", ["saying so", "after the launch"])
def test_stops_that_keep_coming_as_the_ranks_end_never_say_nothing_was_written(tmp_path, monkeypatch, capsys, when):
    # A key held down, or `kill` in a loop: a stop while the launcher said where the run is kept, or while it
    # removed its temporary folder after the ranks had saved, ended in "interrupted; nothing was written".
    import signal
    import tempfile

    from gpipe_cli import runs
    from gpipe_cli.cli import run

    run_dir = tmp_path / "run"

    def launch(module, args, *rest, **kwargs):
        (run_dir / "checkpoints" / "step-00000001").mkdir(parents=True)
        if when == "saying so":
            raise KeyboardInterrupt
        return 143

    def stopped_again(path):
        signal.raise_signal(signal.SIGINT)
        return real_candidates(path)

    class Folder(tempfile.TemporaryDirectory):
        def __exit__(self, *exc):
            signal.raise_signal(signal.SIGTERM)
            return super().__exit__(*exc)

    real_candidates = runs.candidates
    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    monkeypatch.setattr("gpipe_cli.train.run.candidates", stopped_again)
    monkeypatch.setattr("gpipe_cli.train.run.tempfile.TemporaryDirectory", Folder)
    recipe = recipes.write(tmp_path, recipes.TINY_AMOEBANET)
    code = run(["train", str(recipe), "--plain", "--output-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert "nothing was written" not in err
    if when == "saying so":
        assert code == 130
        assert err == f"gpipe train: interrupted; {run_dir} keeps what the run wrote; continue with gpipe train " \
                      f"--resume {run_dir}\n"
    else:
        assert code == 143 and err == ""  # the ranks said how they stopped


def test_fp16_on_a_cpu_is_said_to_be_slow_before_the_ranks_start(tmp_path, launches):
    # fp16 trained several times slower than fp32 on a CPU, without a word.
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU runs fp16 fast")
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    result = train(str(path), "--output-dir", str(tmp_path / "out"), "--set", "train.precision=fp16",
                   "--set", "schedule.warmup_steps=1000")
    assert result.exit_code == 0, result.output
    assert "s] note: schedule.warmup_steps (1000) is longer than the run" in result.stdout
    assert "train.precision fp16 on a CPU: most CPUs have no fast float16 arithmetic" in result.stdout
    assert "s] note: train.precision fp16" in result.stdout  # a note is called one, as validate calls it
    assert "fast float16" not in train(str(path), "--output-dir", str(tmp_path / "out2")).stdout
