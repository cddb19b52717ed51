"""A resume without a recipe continues the run as it was started: the run's own recipe.yaml, with the
resume's `--set` on top, said in one line before any rank starts; checked without starting ranks."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from gpipe_cli.cli import app
from gpipe_cli.cli import run as cli
from gpipe_cli.launch import launcher
from gpipe_cli.launch.launcher import launch_options
from gpipe_cli.launch.preflight import NODE_FLAGS, node_flags
from gpipe_cli.recipe.load import load_recipe, recipe_yaml
from gpipe_cli.train import checkpoint
from gpipe_cli.train.existing import continue_command, start_again
from tests.launch.test_slurm import step_env
from tests.train.test_existing_run import error_line, hashes, make_run, save

runner = CliRunner()


@pytest.fixture
def jobs(monkeypatch) -> list[dict]:
    """The jobs the launcher would start (no rank starts)."""
    started: list[dict] = []

    def launch(module, args, *rest, **kwargs):
        started.append(json.loads(Path(args[0]).read_text()))
        return 0

    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    return started


def resume(*args: str):
    return runner.invoke(app, ["train", "--plain", *args])


def resume_lines(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("resuming")]


def test_a_resume_without_a_recipe_trains_with_the_runs_own_settings(tmp_path, jobs):
    _, run = make_run(tmp_path, None, "train.steps=20", "checkpoint.every=5", steps=(5, 10))
    before = hashes(run)
    result = resume("--resume", str(run))
    assert result.exit_code == 0, result.output
    assert resume_lines(result) == [f"resuming {run} at step 10 with the run's own settings ({run}/recipe.yaml)"]
    assert "differ" not in result.stdout
    (job,) = jobs
    assert job["recipe"]["train"]["steps"] == 20 and job["recipe"]["checkpoint"]["every"] == 5
    assert job["recipe"]["name"] == "tiny-translation"  # not the built-in quick start's
    assert "20 steps" in result.stdout.splitlines()[0]  # the first line already says what the run trains
    assert hashes(run) == before


def test_a_set_on_the_resume_is_applied_to_the_runs_settings_and_said_before_any_rank_starts(tmp_path, jobs):
    _, run = make_run(tmp_path, None, "train.steps=20", "checkpoint.every=5", steps=(10,))
    result = resume("--resume", str(run), "--set", "train.steps=30")
    assert result.exit_code == 0, result.output
    assert resume_lines(result) == [f"resuming {run} at step 10 with train.steps 20 -> 30 (--set)"]
    assert result.stdout.index("resuming") < result.stdout.index("starting 2 ranks")
    (job,) = jobs
    assert job["recipe"]["train"]["steps"] == 30 and job["recipe"]["checkpoint"]["every"] == 5


def test_a_checkpoint_location_continues_its_run_from_that_checkpoint(tmp_path, jobs):
    _, run = make_run(tmp_path, None, "train.steps=20", steps=(5, 10))
    result = resume("--resume", str(run / "checkpoints" / "step-00000005"))
    assert result.exit_code == 0, result.output
    # Its checkpoints keep no recipe, as an older version's: a later resume may have changed the run's.
    assert resume_lines(result) == [f"resuming {run} at step 5 with the run's own settings ({run}/recipe.yaml); "
                                    "checkpoint step-00000005, of an older gpipe-cli, keeps no settings of its own: "
                                    "these are the run's newest, which a later resume may have changed"]
    assert jobs[0]["recipe"]["train"]["steps"] == 20
    result = resume("--resume", str(run / "checkpoints" / "step-00000010"))  # the newest: the run's are its own
    assert resume_lines(result) == [f"resuming {run} at step 10 with the run's own settings ({run}/recipe.yaml)"]


def test_a_resume_back_to_an_earlier_checkpoint_takes_its_courses_settings(tmp_path, jobs):
    # A later resume had set optimizer.lr ten times higher in the run's recipe.yaml, and going back to step 5 trained
    # its course on with that, the line saying only "train.steps 20 -> 12".
    path, run = make_run(tmp_path, None, "train.steps=20", steps=(10,))
    earlier = checkpoint.path_for(run, 5)
    course = recipe_yaml(load_recipe(path, ["train.steps=20", "optimizer.lr=0.003"]))
    checkpoint.save(earlier, checkpoint.state_of(nn.Linear(3, 2), None, {"train": {"step": torch.tensor(5)}}),
                    {"step": 5}, 5, rank=0, group=None, extra={"recipe.yaml": course.encode()})
    (run / "recipe.yaml").write_text(recipe_yaml(load_recipe(path, ["train.steps=20", "optimizer.lr=0.03"])))
    result = resume("--resume", str(earlier), "--set", "train.steps=12")
    assert result.exit_code == 0, result.output
    assert resume_lines(result) == [f"resuming {run} at step 5 with the settings of checkpoint step-00000005 "
                                    f"({earlier}/recipe.yaml), with train.steps 20 -> 12 (--set)"]
    assert jobs[0]["recipe"]["optimizer"]["lr"] == 0.003
    # The run's newest checkpoint goes on with the run's own settings, the latest resume's.
    result = resume("--resume", str(run / "checkpoints" / "step-00000010"))
    assert resume_lines(result) == [f"resuming {run} at step 10 with the run's own settings ({run}/recipe.yaml)"]
    assert jobs[1]["recipe"]["optimizer"]["lr"] == 0.03
    # At its end already, the checkpoint is named, not the run, which is at step 10.
    result = resume("--resume", str(earlier), "--set", "train.steps=5")
    assert result.exit_code == 0 and len(jobs) == 2
    assert f"checkpoint {earlier} is at step 5 (train.steps 5), the end already; nothing to do" in result.stdout


def test_a_bare_resume_into_an_output_dir_continues_that_run_with_its_settings(tmp_path, jobs):
    _, run = make_run(tmp_path, None, "train.steps=20", steps=(10,))
    result = resume("--output-dir", str(run), "--resume", "latest")
    assert result.exit_code == 0, result.output
    assert resume_lines(result) == [f"resuming {run} at step 10 with the run's own settings ({run}/recipe.yaml)"]
    assert jobs[0]["recipe"]["train"]["steps"] == 20


def test_a_bare_resume_finds_the_newest_quick_start_run_and_keeps_its_steps(tmp_path, jobs, monkeypatch, capsys):
    # As a new user types it: `gpipe train --set train.steps=2000`, Ctrl-C, then `gpipe train --resume`.
    monkeypatch.chdir(tmp_path)
    run = Path("outputs/quickstart/20261123-051412")
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text(recipe_yaml(load_recipe(None, ["train.steps=2000"])))
    save(run, 95)
    assert cli(["train", "--plain", "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} at step 95 with the run's own settings ({run}/recipe.yaml)\n" in out
    assert jobs[0]["recipe"]["train"]["steps"] == 2000


def test_an_invalid_set_on_the_runs_settings_is_one_line_naming_its_recipe_yaml(tmp_path, jobs):
    _, run = make_run(tmp_path, None, "train.steps=20", steps=(10,))
    result = resume("--resume", str(run), "--set", "pipeline.microbatches=0")
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith(f"error: {run}/recipe.yaml: --set pipeline.microbatches: must be >= 1")
    assert not jobs


def test_a_run_without_recipe_yaml_asks_for_the_recipe_in_one_line(tmp_path, jobs):
    _, run = make_run(tmp_path, None, steps=(10,))
    (run / "recipe.yaml").unlink()
    result = resume("--resume", str(run))
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --resume {run}: the run has no recipe.yaml to continue with; give the "
                                  f"recipe it was started with: gpipe train RECIPE --resume {run}")
    assert not jobs


@pytest.mark.parametrize("what, says", [("folder", "not a run directory (no recipe.yaml, metrics.jsonl or "
                                                    "checkpoints); give a folder gpipe train wrote"),
                                         ("file", "is a file; give a run directory or one of its checkpoint folders")])
def test_a_resume_location_that_is_no_run_is_named_as_what_it_is(tmp_path, jobs, what, says):
    place = tmp_path / "place"
    place.mkdir() if what == "folder" else place.write_text("{}")
    result = resume("--resume", str(place))
    assert result.exit_code == 2, result.output
    assert says in error_line(result)
    assert not jobs


def test_a_folder_whose_records_are_empty_is_not_said_to_lack_them(tmp_path, jobs):
    # It said "no recipe.yaml, metrics.jsonl or checkpoints" of a folder holding an empty metrics.jsonl.
    place = tmp_path / "place"
    place.mkdir()
    (place / "metrics.jsonl").write_text("")
    result = resume("--resume", str(place))
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --resume {place}: not a run directory (no recipe.yaml or checkpoints, and "
                                  "its metrics.jsonl is empty); give a folder gpipe train wrote, or one of its "
                                  "checkpoint folders")
    assert not jobs


def test_a_missing_resume_location_is_one_line(tmp_path, jobs):
    result = resume("--resume", str(tmp_path / "nowhere"))
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith("error: --resume: no such run directory or checkpoint: ")


def test_a_recipe_given_with_resume_is_used_and_every_difference_listed(tmp_path, jobs):
    path, run = make_run(tmp_path, None, "train.steps=20", "optimizer.lr=0.01", steps=(2,))
    result = runner.invoke(app, ["train", str(path), "--plain", "--resume", str(run)])
    assert result.exit_code == 0, result.output
    assert resume_lines(result) == [f"resuming {run} at step 2 with {path}, which differs from the run's "
                                    f"recipe.yaml: optimizer.lr 0.01 -> 0.001, train.steps 20 -> 3"]
    assert jobs[0]["recipe"]["train"]["steps"] == 3  # the recipe given, as before


def test_the_command_to_continue_is_ready_to_copy(tmp_path):
    assert continue_command(Path("outputs/quickstart/20261123-051412")) == (
        "gpipe train --resume outputs/quickstart/20261123-051412")
    assert continue_command(Path("runs/job 17")) == "gpipe train --resume 'runs/job 17'"
    # A run directory named -run: `gpipe train --resume -run` was "No such option: -run".
    assert continue_command(Path("-run")) == "gpipe train --resume ./-run"
    assert continue_command(Path("/runs/-a")) == "gpipe train --resume /runs/-a"


@pytest.mark.parametrize(("options", "flags"), [
    (dict(), ""),
    (dict(nnodes="2", node_rank=0, rdzv_endpoint="host0:29500"),
     "--nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500 (each node with its own --node-rank)"),
    (dict(nnodes="2", rdzv_backend="c10d", rdzv_endpoint="host0:29500", rdzv_id="job 7"),
     "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint host0:29500 --rdzv-id 'job 7' (on every node)"),
    (dict(environ=step_env(1)), "(on every node of an srun step)"),  # Slurm gives the flags again
    (dict(environ=step_env(1), rdzv_id="mine"), "--rdzv-id mine (on every node of an srun step)"),
])
def test_on_several_nodes_the_command_to_continue_names_the_launch_flags_typed(options, flags, monkeypatch):
    # It named none: `gpipe train --resume RUN` alone on node 0 started a job of one node.
    monkeypatch.delenv(NODE_FLAGS, raising=False)
    given = node_flags(launch_options(**options))
    assert given == flags
    assert continue_command(Path("runs/a"), given) == f"gpipe train --resume runs/a {flags}".strip()
    monkeypatch.setenv(NODE_FLAGS, given)  # as the launcher hands them to its ranks
    assert continue_command(Path("runs/a")) == f"gpipe train --resume runs/a {flags}".strip()
    assert start_again(Path("runs/a")).endswith(f"--output-dir runs/a {flags}".strip())


def test_the_launcher_hands_its_ranks_the_flags_that_continue_the_run(monkeypatch):
    monkeypatch.delenv(NODE_FLAGS, raising=False)
    options = launch_options(nnodes="2", node_rank=1, rdzv_endpoint="host0:29500")
    with launcher._giving_ranks(1, options):
        assert os.environ[NODE_FLAGS] == node_flags(options) != ""
    assert NODE_FLAGS not in os.environ
