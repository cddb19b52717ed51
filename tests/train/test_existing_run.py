"""An existing run directory, checked before any rank starts: resumes that would lose or mix data are refused
in one line and write nothing; other changes are said; a finished run resumed again does nothing."""

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from typer.testing import CliRunner

from gpipe_cli import runs
from gpipe_cli.cli import app
from gpipe_cli.errors import UserError
from gpipe_cli.recipe.load import load_recipe, recipe_yaml
from gpipe_cli.train import checkpoint, existing
from gpipe_cli.train import resume as resuming
from gpipe_cli.train.existing import fork_of, resume_line
from tests.train import recipes

runner = CliRunner()


def save(run: Path, step: int, keep: int = 5) -> Path:
    """A real, whole checkpoint of a small module (what the checks read: manifest, checksums, metadata)."""
    module = nn.Linear(3, 2)
    state = checkpoint.state_of(module, None, {"train": {"step": torch.tensor(step)}})
    run.mkdir(parents=True, exist_ok=True)  # a run's folder is made before its first checkpoint
    path = checkpoint.path_for(run, step)
    checkpoint.save(path, state, {"step": step}, keep, rank=0, group=None)
    return path


def make_run(tmp_path: Path, recipe: dict | None = None, *overrides: str, steps: tuple[int, ...] = (5, 10)):
    """A run directory as `gpipe train RECIPE --set OVERRIDES` leaves it: (recipe file, run directory)."""
    path = recipes.write(tmp_path, copy.deepcopy(recipe or recipes.TINY_TRANSLATION))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text(recipe_yaml(load_recipe(path, list(overrides))))
    records = [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, max(steps) + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step in steps:
        save(run, step)
    return path, run


def hashes(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) by its content."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test should any rank be started; record the launches that a test allows."""
    started: list[int] = []

    def launch(*args, **kwargs):
        started.append(1)
        return 0

    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    return started


def train(path: Path, run: Path, *args: str):
    return runner.invoke(app, ["train", str(path), "--output-dir", str(run), "--plain", *args])


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


# ----------------------------------------------------------------- a checkpoint past train.steps (defect: data loss)

def test_a_checkpoint_past_train_steps_is_refused_before_any_rank_starts_and_nothing_is_written(tmp_path, no_ranks):
    path, run = make_run(tmp_path, None, "train.steps=10", "checkpoint.every=5")
    before = hashes(run)
    result = train(path, run, "--resume", "latest", "--set", "train.steps=5", "--set", "checkpoint.every=5")
    assert result.exit_code == 2, result.output
    line = error_line(result)
    assert line.startswith("error: --resume ") and "checkpoint step-00000010 is at step 10, past train.steps 5" in line
    assert line.endswith("resuming would write earlier steps over it; raise train.steps to train past step 10")
    assert hashes(run) == before and not no_ranks


def test_a_run_already_at_train_steps_says_so_in_one_line_and_exits_0_writing_nothing(tmp_path, no_ranks):
    path, run = make_run(tmp_path, None, "train.steps=10", "checkpoint.every=5")
    before = hashes(run)
    result = train(path, run, "--resume", "latest", "--set", "train.steps=10", "--set", "checkpoint.every=5")
    assert result.exit_code == 0, result.output
    done = [line for line in result.stdout.splitlines() if "already complete" in line]
    assert done == [f"the run in {run} is already complete at step 10 (train.steps 10); nothing to do "
                    f"(raise train.steps to train past step 10)"], result.output
    assert result.stderr == "" and "resuming" not in result.stdout
    assert hashes(run) == before and not no_ranks


def test_only_a_checkpoint_the_ranks_would_load_decides(tmp_path):
    _, run = make_run(tmp_path, steps=(4, 10))
    newest = checkpoint.path_for(run, 10)
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(bytes(b ^ 0xFF for b in shard.read_bytes()))  # its checksum fails: the ranks fall back
    recipe = load_recipe(recipes.write(tmp_path, recipes.TINY_TRANSLATION), ["train.steps=5"])
    assert existing.resume_end(recipe, str(run)) is None  # step 4 goes on to 5
    recipe = load_recipe(recipes.write(tmp_path, recipes.TINY_TRANSLATION), ["train.steps=4"])
    assert existing.resume_end(recipe, str(run)) == 4


def test_with_train_epochs_the_end_is_left_to_the_ranks_unless_train_steps_alone_is_passed(tmp_path):
    _, run = make_run(tmp_path, steps=(10,))
    path = recipes.write(tmp_path, recipes.TINY_TRANSLATION)
    assert existing.resume_end(load_recipe(path, ["train.steps=10", "train.epochs=1"]), str(run)) is None
    assert existing.resume_end(load_recipe(path, ["train.steps=null", "train.epochs=1"]), str(run)) is None
    with pytest.raises(UserError, match="past train.steps 9"):
        existing.resume_end(load_recipe(path, ["train.steps=9", "train.epochs=1"]), str(run))


def test_an_explicit_checkpoint_is_judged_by_its_own_step(tmp_path):
    _, run = make_run(tmp_path, steps=(5, 10))
    recipe = load_recipe(recipes.write(tmp_path, recipes.TINY_TRANSLATION), ["train.steps=7"])
    assert existing.resume_end(recipe, str(checkpoint.path_for(run, 5))) is None
    with pytest.raises(UserError, match="checkpoint step-00000010 is at step 10, past train.steps 7"):
        existing.resume_end(recipe, str(run))


# ----------------------------------------------------------------- a recipe that changes what checkpoints hold

@pytest.mark.parametrize(("recipe", "change", "named"), [
    (recipes.TINY_TRANSLATION, "model.d_model=64", "model.d_model 32 -> 64"),
    (recipes.TINY_TRANSLATION, "model.layers=3", "model.layers 2 -> 3"),
    (recipes.TINY_TRANSLATION, "model.vocab_size=1024", "model.vocab_size 512 -> 1024"),
    (recipes.TINY_TRANSLATION, "optimizer.name=sgd", "optimizer.name adam -> sgd"),
    (recipes.TINY_AMOEBANET, "model.filters=16", "model.filters 8 -> 16"),
    (recipes.TINY_AMOEBANET, "optimizer.momentum=0", "optimizer.momentum 0.9 -> 0.0"),  # no momentum buffer
], ids=["d_model", "layers", "vocab", "optimizer", "filters", "momentum"])
def test_a_resume_that_changes_what_the_checkpoints_hold_is_refused_and_recipe_yaml_is_kept(
        tmp_path, no_ranks, recipe, change, named):
    path, run = make_run(tmp_path, recipe, steps=(2,))
    before = hashes(run)
    result = train(path, run, "--resume", "latest", "--set", change)
    assert result.exit_code == 2, result.output
    line = error_line(result)
    assert line.startswith(f"error: --resume {run}: {named} changes what its checkpoints hold"), line
    assert "resume with the run's value, or start a new run in another --output-dir" in line
    assert "incomplete or corrupt" not in result.output
    assert hashes(run) == before and not no_ranks


def test_a_recipe_of_another_model_family_is_refused_by_its_family_alone(tmp_path):
    # Every model key was listed, and the line, cut to its length, hid model.kind among fifteen.
    path, run = make_run(tmp_path, steps=(2,))
    recipe = load_recipe(recipes.write(tmp_path, recipes.TINY_AMOEBANET, "other.yaml"), [])
    with pytest.raises(UserError) as refused:
        existing.check_checkpoint_keys(recipe, existing.recipe_changes(recipe, run), str(run))
    assert str(refused.value) == (f"--resume {run}: model.kind transformer -> amoebanet changes what its checkpoints "
                                  "hold (the model's parameters and the optimizer's state); resume with the run's "
                                  "value, or start a new run in another --output-dir")


def test_a_tokenizer_file_replaced_since_the_run_started_is_refused(tmp_path):
    # The resume said nothing, and trained on another tokenizer's ids: step 5's loss 6.74 against 6.38.
    from gpipe_cli.data.synthetic import translation_pairs
    from gpipe_cli.data.tokenizer import train_tokenizer
    from gpipe_cli.runs import TOKENIZER_FILE

    texts = [s for p in translation_pairs(100, 0, "train") for s in p]
    given = train_tokenizer(texts, 40).save(tmp_path / "tok.model")
    path, run = make_run(tmp_path, recipes.TINY_TRANSLATION, f"data.tokenizer={given}", steps=(2,))
    (run / TOKENIZER_FILE).write_bytes(given.read_bytes())  # as the run keeps it
    recipe = load_recipe(path, [f"data.tokenizer={given}"])
    existing.check_tokenizer_kept(recipe, str(run))
    train_tokenizer(texts[::-1], 38).save(given)
    with pytest.raises(UserError, match=r"data.tokenizer '.*tok.model' is not the tokenizer the run started with "
                                        r"\(its copy: .*tokenizer.model\), whose ids its checkpoints' embeddings "
                                        r"learned; put that file back, or start a new run in another --output-dir$"):
        existing.check_tokenizer_kept(recipe, str(run))


def test_a_model_change_in_an_edited_run_recipe_is_refused_by_the_checkpoints_own_recipe(tmp_path):
    # The run's recipe.yaml, edited since, was compared alone: the ranks then failed to load the checkpoint and
    # advised training again from step 0.
    path, run = make_run(tmp_path, steps=(2,))
    shutil.copy(run / "recipe.yaml", runs.candidates(run)[0] / "recipe.yaml")  # as the loop saves it
    edited = load_recipe(path, ["model.d_model=64"])
    (run / "recipe.yaml").write_text(recipe_yaml(edited))
    assert existing.recipe_changes(edited, run) == []
    with pytest.raises(UserError, match=r"model.d_model 32 -> 64 changes what its checkpoints hold"):
        existing.check_checkpoint_keys(edited, existing.held_changes(edited, str(run)) or [], str(run))
    (run / "recipe.yaml").unlink()  # and with the run's lost
    with pytest.raises(UserError, match=r"model.d_model 32 -> 64 changes what its checkpoints hold"):
        existing.check_checkpoint_keys(edited, existing.held_changes(edited, str(run)) or [], str(run))


def test_a_checkpoint_copied_out_of_its_run_is_refused_by_resume_and_exported_only_to_a_named_file(tmp_path):
    # Its run was taken to be the folder two levels up: the user's recipe.yaml and metrics.jsonl there were
    # replaced by the run's, and an export wrote model.safetensors there.
    _, run = make_run(tmp_path, steps=(2,))
    project = tmp_path / "project"
    (project / "stash").mkdir(parents=True)
    shutil.copytree(runs.candidates(run)[0], project / "stash" / "step-00000002")
    (project / "recipe.yaml").write_text("my notes\n")
    before = hashes(project)
    loose = project / "stash" / "step-00000002"
    result = runner.invoke(app, ["train", "--resume", str(loose), "--plain"])
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith("error: --resume: '") and line.endswith(
        " is a checkpoint outside a run's checkpoints/ (it lies in 'stash'), and a resume writes its "
        "run in the folder above that; put it in a run folder's checkpoints/ with its recipe.yaml beside them, and "
        "resume that folder")
    with pytest.raises(UserError, match=r"is a checkpoint outside a run's checkpoints/ \(it lies in 'stash'\); name "
                                        r"the file to write with --output FILE.safetensors$"):
        existing.check_export_arguments(str(loose), None)
    existing.check_export_arguments(str(loose), str(tmp_path / "weights.safetensors"))
    for kept in (runs.candidates(run)[0], run / "checkpoints" / "superseded-1-at-step-1" / "step-00000001"):
        assert existing.loose(str(kept)) is None
    assert hashes(project) == before


def test_every_refused_key_is_named_in_the_one_line(tmp_path):
    path, run = make_run(tmp_path, steps=(2,))
    recipe = load_recipe(path, ["model.d_model=64", "model.ff=128", "train.steps=9"])
    changes = existing.recipe_changes(recipe, run)
    with pytest.raises(UserError) as refused:
        existing.check_checkpoint_keys(recipe, changes, str(run))
    assert "model.d_model 32 -> 64, model.ff 64 -> 128 change what its checkpoints hold" in str(refused.value)
    assert "train.steps" not in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("change", ["data.vocab_size=40", "data.tokenizer=other.model"])
def test_a_resume_that_changes_the_tokenizer_is_refused(tmp_path, change):
    # The run's tokenizer.model was reused without a word for data.vocab_size; data.tokenizer swapped it, and the
    # checkpoint's embeddings trained on, and were read, with another tokenizer's ids.
    from gpipe_cli.data.synthetic import translation_pairs
    from gpipe_cli.data.tokenizer import train_tokenizer

    path, run = make_run(tmp_path, steps=(2,))
    train_tokenizer([s for p in translation_pairs(100, 0, "train") for s in p], 40).save(tmp_path / "other.model")
    recipe = load_recipe(path, [change.replace("other.model", str(tmp_path / "other.model"))])
    with pytest.raises(UserError) as refused:
        existing.check_checkpoint_keys(recipe, existing.recipe_changes(recipe, run), str(run))
    key = change.split("=")[0]
    assert str(refused.value).startswith(f"--resume {run}: {key} ")
    assert str(refused.value).endswith("changes the tokenizer, whose ids its checkpoints' embeddings learned (the "
                                       "run keeps its own); resume with the run's value, or start a new run in "
                                       "another --output-dir")


@pytest.mark.parametrize("change", [
    "pipeline.partitions=1", "pipeline.balance=[1,5]", "pipeline.microbatches=2", "pipeline.schedule=1f1b",
    "pipeline.data_parallel=2", "model.dropout=0.2", "model.label_smoothing=0", "optimizer.lr=0.01",
    "optimizer.momentum=0", "train.precision=bf16", "seed=7", "data.batch_size=12", "checkpoint.keep=9",
])
def test_changes_that_keep_the_checkpoints_loadable_are_allowed(tmp_path, change):
    path, run = make_run(tmp_path, steps=(2,))  # adam: momentum is not its state
    recipe = load_recipe(path, [change])
    changes = existing.recipe_changes(recipe, run)
    assert changes and len(changes) == 1
    existing.check_checkpoint_keys(recipe, changes, str(run))


def test_a_run_without_a_readable_recipe_yaml_is_not_compared(tmp_path):
    path, run = make_run(tmp_path, steps=(2,))
    recipe = load_recipe(path, ["model.d_model=64"])
    (run / "recipe.yaml").write_text("{{ not yaml")
    assert existing.recipe_changes(recipe, run) is None
    (run / "recipe.yaml").unlink()
    assert existing.recipe_changes(recipe, run) is None


# ----------------------------------------------------------------- other changes: said, then recorded

def test_with_a_recipe_every_difference_from_the_run_is_listed_in_one_line(tmp_path):
    path, run = make_run(tmp_path, None, "train.steps=20", "checkpoint.every=5", steps=(20,))
    changes = existing.recipe_changes(load_recipe(path, ["train.steps=27"]), run)
    assert resume_line(run, 20, changes, str(path), continued=False, overrides=["train.steps=27"]) == (
        f"resuming {run} at step 20 with {path} and --set, which differ from the run's recipe.yaml: "
        f"checkpoint.every 5 -> null, train.steps 20 -> 27")
    assert existing.recipe_changes(load_recipe(path, ["train.steps=20", "checkpoint.every=5"]), run) == []
    assert resume_line(run, 20, [], str(path), continued=False, overrides=[]) == (
        f"resuming {run} at step 20 with {path}, the same settings as the run's")


def test_the_line_is_printed_before_the_ranks_start_and_recipe_yaml_is_left_to_them(tmp_path, no_ranks):
    path, run = make_run(tmp_path, None, "train.steps=20", "checkpoint.every=5", steps=(20,))
    before = hashes(run)
    result = train(path, run, "--resume", "latest", "--set", "train.steps=27")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if line.startswith("resuming")]
    assert notes == [f"resuming {run} at step 20 with {path} and --set, which differ from the run's recipe.yaml: "
                     f"checkpoint.every 5 -> null, train.steps 20 -> 27"]
    assert result.stdout.index(notes[0]) < result.stdout.index("starting 2 ranks")
    assert no_ranks == [1] and hashes(run) == before  # the ranks record the settings, once the resume loads


def test_a_value_set_on_one_side_only_is_shown_as_not_set():
    change = existing.Change("metrics.wandb", None, {"project": "p", "mode": "offline"})
    assert str(change) == "metrics.wandb null -> {project: p, mode: offline}"
    assert str(existing.Change("model.d_model", existing._ABSENT, 64)) == "model.d_model (not set) -> 64"


# ----------------------------------------------------------------- a new run into a directory that holds one

@pytest.mark.parametrize("held", ["metrics and checkpoints", "metrics", "checkpoints"])
def test_a_new_run_into_a_directory_that_holds_a_run_is_refused_before_any_rank_starts(tmp_path, no_ranks, held):
    path, run = make_run(tmp_path, steps=(4,))
    if held == "checkpoints":
        (run / "metrics.jsonl").unlink()
    if held == "metrics":
        for folder in (run / "checkpoints").iterdir():
            shutil.rmtree(folder)
    before = hashes(run)
    result = train(path, run)
    assert result.exit_code == 2, result.output
    # Records alone leave a resume nothing to continue: it is told how to start the run again.
    advice = (f" but no checkpoint; start it again from step 0 with: gpipe train --resume --output-dir {run}, or "
              f"give another --output-dir" if held == "metrics" else "; use --resume to continue it, or another "
              "--output-dir")
    assert error_line(result) == (f"error: --output-dir {run} already holds a run (its last step is 4){advice} for a "
                                  f"new run")
    assert result.stdout == ""  # found before torch is imported, before even the first line
    assert hashes(run) == before and not no_ranks


@pytest.mark.parametrize("flags", [["--output-dir", "OUT"], ["--resume", "OUT"], ["--output-dir", "OUT", "--resume"]])
def test_a_run_directory_name_too_long_is_one_line_naming_the_flag_before_anything_starts(tmp_path, monkeypatch,
                                                                                         no_ranks, capsys, flags):
    # Python 3.11's pathlib raised "File name too long" from is_dir(): a traceback.
    from gpipe_cli.cli import run

    monkeypatch.chdir(tmp_path)
    long = "outputs/" + "a" * 300
    code = run(["train", "--plain", "--set", "train.steps=2", *[long if f == "OUT" else f for f in flags]])
    captured = capsys.readouterr()
    flag = flags[0]
    assert code == 2 and captured.out == "" and len(captured.err.splitlines()) == 1, captured
    assert captured.err.startswith(f"error: {flag}: 'outputs/aaa") and captured.err.endswith(
        " has a name of 300 bytes; a name may have at most 255 bytes, a path at most 4095 bytes\n"), captured.err
    assert list(tmp_path.iterdir()) == [] and not no_ranks


def test_an_empty_output_dir_is_refused_rather_than_read_as_none(tmp_path, monkeypatch, no_ranks, capsys):
    # `--output-dir ''` sent the run to outputs/<name>/<time>, as if the flag were not there.
    from gpipe_cli.cli import run

    monkeypatch.chdir(tmp_path)
    assert run(["train", "--plain", "--output-dir", ""]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("error: --output-dir: an empty path names no directory; give one, or leave the flag out "
                            "for outputs/<name>/<time>\n") and captured.out == ""
    assert list(tmp_path.iterdir()) == [] and not no_ranks


@pytest.mark.parametrize("resume", [(), ("--resume", "latest")])
@pytest.mark.parametrize("name", ["recipe.yaml", "tokenizer.model"])
def test_a_new_run_never_writes_over_a_users_file_of_a_name_it_writes(tmp_path, no_ranks, name, resume):
    # `gpipe train my.yaml --output-dir .` in a folder holding the user's recipe.yaml replaced it, exit code 0; with
    # a bare --resume (which starts a run where there is none) it still did, and trained on a stray tokenizer.
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / name).write_text("name: mine\n")
    result = train(path, folder, *resume)
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --output-dir {folder} holds a {name} but no run (no records or "
                                  f"checkpoints), and a new run writes its own {name} there; give a new or empty "
                                  f"folder, or move the file")
    assert (folder / name).read_text() == "name: mine\n" and not no_ranks


def test_a_new_run_never_writes_over_the_recipe_it_was_given(tmp_path, monkeypatch, no_ranks, capsys):
    # `gpipe train recipe.yaml --output-dir .` beside it replaced the user's recipe with the resolved one.
    from gpipe_cli.cli import run
    from gpipe_cli.recipe.load import default_recipe_text

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(default_recipe_text())
    for resume in ([], ["--resume"]):  # a bare --resume into a folder without a run starts one
        assert run(["train", "recipe.yaml", "--plain", "--output-dir", ".", *resume]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: --output-dir .: its recipe.yaml is the recipe given, which the run "
                                       "would replace") and len(captured.err.splitlines()) == 1, captured.err
    assert (tmp_path / "recipe.yaml").read_text() == default_recipe_text() and not no_ranks


def test_an_empty_or_never_started_directory_takes_a_new_run(tmp_path):
    existing.check_new_run_dir(tmp_path / "missing")
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    existing.check_new_run_dir(folder)
    (folder / "metrics.jsonl").write_text("")  # stopped during set-up: no step was recorded
    (folder / "recipe.yaml").write_text("name: x\n")
    (folder / "checkpoints" / ".step-00000001.partial").mkdir()
    existing.check_new_run_dir(folder)
    assert not runs.holds_run(folder)


@pytest.fixture
def jobs(monkeypatch) -> list[dict]:
    """The jobs `gpipe train` hands its ranks, recorded in place of starting them."""
    handed: list[dict] = []

    def launch(module, args, *rest, **kwargs):
        handed.append(json.loads(Path(args[0]).read_text()))
        return 0

    monkeypatch.setattr("gpipe_cli.train.run.launch", launch)
    return handed


def test_resume_into_an_output_dir_that_holds_no_run_yet_starts_one_there(tmp_path, jobs, capsys):
    # A scheduler runs the same command on the first launch and on a requeue: `--output-dir D --resume`.
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    from gpipe_cli.cli import run  # as typed: a bare --resume
    assert run(["train", str(path), "--output-dir", str(tmp_path / "job-17"), "--plain", "--resume"]) == 0
    assert "holds no run yet; starting a new one there" in capsys.readouterr().out
    assert jobs and jobs[0]["resume"] is None and jobs[0]["output_dir"] == str(tmp_path / "job-17")


def test_a_requeued_job_killed_before_its_first_checkpoint_starts_again(tmp_path, jobs, capsys):
    # Its steps were recorded, no checkpoint written: every requeue was refused ("no usable checkpoint").
    path = recipes.write(tmp_path, copy.deepcopy(recipes.TINY_TRANSLATION))
    job = tmp_path / "job-18"
    (job / "checkpoints" / ".step-00000004.partial").mkdir(parents=True)  # cut short by the kill
    (job / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n')
    from gpipe_cli.cli import run

    assert run(["train", str(path), "--output-dir", str(job), "--plain", "--resume"]) == 0
    assert ("holds no checkpoint yet; the run starts there again from step 0 (the steps it recorded are dropped)"
            in capsys.readouterr().out)
    assert jobs and jobs[0]["resume"] is None and (job / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize("given", ["run", "checkpoint"])
def test_output_dir_beside_a_resume_of_a_run_elsewhere_is_refused_before_anything_starts(tmp_path, no_ranks, given):
    # It was ignored: the resume trained on in the run it named, and --output-dir was never made.
    _, run = make_run(tmp_path, steps=(4,))
    before = hashes(run)
    location = run if given == "run" else run / "checkpoints" / "step-00000004"
    which = "its run" if given == "run" else f"the run in {run}"
    other = tmp_path / "other"
    result = runner.invoke(app, ["train", "--plain", "--resume", str(location), "--output-dir", str(other), "--set",
                                 "train.steps=8"])
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --output-dir {other}: --resume continues {which} where it is; drop "
                                  "--output-dir, or give it with a bare --resume to continue the run there")
    assert result.stdout == "" and not other.exists() and hashes(run) == before and not no_ranks


def test_output_dir_that_is_the_resumed_run_itself_is_accepted(tmp_path, no_ranks):
    _, run = make_run(tmp_path, steps=(4,))
    result = runner.invoke(app, ["train", "--plain", "--resume", str(run / "checkpoints" / "step-00000004"),
                                 "--output-dir", f"{run}/", "--set", "train.steps=8"])
    assert result.exit_code == 0, result.output
    assert f"resuming {run} at step 4" in result.stdout and no_ranks == [1]


def test_the_last_step_comes_from_metrics_else_the_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000012").mkdir(parents=True)
    assert runs.last_step(run) == 12
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 14}\n{"kind": "tra')  # a torn last line
    assert runs.last_step(run) == 14


# ----------------------------------------------------------------- a save cut short; retention

def test_stale_partial_folders_are_removed_and_nothing_else(tmp_path):
    whole = save(tmp_path, 20)
    stale = checkpoint.partial_for(checkpoint.path_for(tmp_path, 25))
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x" * 1000)
    other = tmp_path / "checkpoints" / ".keep-me"
    other.write_text("")
    assert checkpoint.remove_partials(tmp_path) == [stale]
    assert not stale.exists() and other.exists()
    assert checkpoint.inspect(whole, verify=True)[1] is None
    assert checkpoint.remove_partials(tmp_path / "nothing-here") == []


def test_a_resume_from_an_earlier_checkpoint_moves_the_newer_ones_out_of_the_next_resumes_way(tmp_path):
    # They stayed: the next --resume would have continued the course the run had left (its metrics trimmed).
    kept, newer = save(tmp_path, 4), [save(tmp_path, 6), save(tmp_path, 7)]
    aside = checkpoint.set_aside_newer(tmp_path, 4, "20261202-101010")
    assert aside == tmp_path / "checkpoints" / "superseded-20261202-101010-at-step-4"
    assert sorted(p.name for p in aside.iterdir()) == [p.name for p in newer]
    assert checkpoint.candidates(tmp_path) == [kept]
    # One of them can still be resumed: it belongs to this run (it was named a checkpoints/ folder's).
    assert runs.run_dir_of(str(aside / newer[0].name)) == tmp_path
    # A resume of it continues that course, which branched at step 4.
    assert fork_of(aside / newer[0].name) == 4 and fork_of(kept) is None
    assert checkpoint.set_aside_newer(tmp_path, 4, "later") is None  # nothing newer: nothing made
    again = save(tmp_path, 5)  # another resume from step 4 within the same second
    assert checkpoint.set_aside_newer(tmp_path, 4, "20261202-101010") == aside.with_name(f"{aside.name}-1")
    assert fork_of(aside.with_name(f"{aside.name}-1") / again.name) == 4
    assert not again.exists() and sorted(p.name for p in aside.iterdir()) == [p.name for p in newer]


def records(steps: range) -> str:
    return "".join(json.dumps({"kind": "train", "step": s, "loss": 1.0}) + "\n" for s in steps)


def test_a_resume_from_the_newest_checkpoint_leaves_the_records_untouched(tmp_path, monkeypatch):
    # It rewrote metrics.jsonl all the same: on a full disk, no resume could start, and said so in a traceback.
    save(tmp_path, 4)
    (tmp_path / "metrics.jsonl").write_text(records(range(1, 5)))

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resuming, "atomic_write_bytes", full)
    assert resuming.rewind(tmp_path, 4, 4, None, "now") is None
    assert (tmp_path / "metrics.jsonl").read_text() == records(range(1, 5))
    monkeypatch.undo()
    (tmp_path / "metrics.jsonl").write_text(records(range(1, 5)).rstrip("\n"))  # its last newline never written
    resuming.rewind(tmp_path, 4, 4, None, "now")  # the next record would have joined the last line
    assert (tmp_path / "metrics.jsonl").read_text() == records(range(1, 5))


def test_a_resume_that_cannot_rewrite_the_records_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    # The newer checkpoints had gone aside without their records, which the next resume then dropped.
    kept, newer = save(tmp_path, 4), save(tmp_path, 6)
    (tmp_path / "metrics.jsonl").write_text(records(range(1, 7)))
    writes = []

    def full_after_one(path: Path, data: bytes) -> None:
        writes.append(path)
        if len(writes) > 1:  # the records set aside fit; the rewrite of the run's own does not
            raise OSError(28, "No space left on device")
        path.write_bytes(data)

    monkeypatch.setattr(resuming, "atomic_write_bytes", full_after_one)
    with pytest.raises(UserError) as caught:
        resuming.rewind(tmp_path, 4, 4, None, "now")
    assert str(caught.value).startswith(f"cannot rewrite {tmp_path / 'metrics.jsonl'} for the resume from step 4 "
                                        "(No space left on device); ")
    assert str(caught.value).endswith("; the run is as it was: once the file can be written, resume again")
    assert checkpoint.candidates(tmp_path) == [newer, kept] and newer.is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [kept.name, newer.name]
    assert (tmp_path / "metrics.jsonl").read_text() == records(range(1, 7))


def test_a_checkpoint_of_a_run_whose_folder_went_away_is_refused_and_makes_no_folder(tmp_path):
    # The folder was made anew, holding only the checkpoints written after the run's own had been moved.
    save(tmp_path / "run", 2)
    shutil.rmtree(tmp_path / "run")
    state = checkpoint.state_of(nn.Linear(3, 2), None, {"train": {"step": torch.tensor(4)}})
    with pytest.raises(checkpoint.CheckpointWriteError) as caught:
        checkpoint.save(checkpoint.path_for(tmp_path / "run", 4), state, {"step": 4}, 5, rank=0, group=None)
    assert str(caught.value) == (f"cannot write checkpoint step-00000004: the run directory {tmp_path / 'run'} was "
                                 "moved or removed while the run trained")
    assert not (tmp_path / "run").exists()


def test_a_runs_recipe_refused_by_a_limit_added_since_says_how_to_resume_past_it(tmp_path, capsys):
    # "train.stall_timeout: must be >= 10": the user was not told that --set on the resume replaces the value.
    from gpipe_cli.cli import run

    _, run_dir = make_run(tmp_path, None, "train.steps=20")
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    recipe["train"]["stall_timeout"] = 5
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert run(["train", "--resume", str(run_dir), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'recipe.yaml'}: train.stall_timeout: must be >= ") and err.endswith(
        "(got 5); the run's recipe.yaml holds it: --set train.stall_timeout=VALUE on the --resume replaces it\n")
    assert run(["train", "--resume", str(run_dir), "--dry-run", "--set", "train.stall_timeout=10"]) == 0
    assert run(["train", "--resume", str(run_dir), "--dry-run", "--set", "train.stall_timeout=6"]) == 2
    assert "replaces it" not in capsys.readouterr().err  # the --set's own value: said as any --set's


def test_retention_runs_on_the_next_save_after_an_abort_left_one_too_many(tmp_path):
    for step in (10, 15, 20, 23):  # an abort after the rename, before pruning: four with keep 3
        save(tmp_path, step, keep=5)
    save(tmp_path, 25, keep=3)
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step-00000025", "step-00000023", "step-00000020"]


def test_resume_locations_map_to_their_run_directory(tmp_path):
    run = tmp_path / "run"
    assert runs.run_dir_of(str(run)) == run
    assert runs.run_dir_of(str(run / "checkpoints")) == run
    assert runs.run_dir_of(str(run / "checkpoints" / "step-00000005")) == run


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/step-00000004"])
def test_a_new_run_inside_another_runs_checkpoints_is_refused(tmp_path, capsys, inside):
    # Accepted, it was deleted without a word when the other run's retention pruned that checkpoint.
    from gpipe_cli.cli import run

    save(tmp_path / "other", 4)
    target = tmp_path / "other" / inside
    assert run(["train", "--output-dir", str(target), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {target} is inside the run's checkpoints/" in err and err.count("\n") == 1


def test_resume_of_a_runs_recipe_file_continues_that_run(tmp_path):
    # Read as a recipe with a bare --resume, it continued the newest run of that recipe's name instead.
    from gpipe_cli.cli import _bare_resume

    save(tmp_path / "run", 4)
    recipe = str(tmp_path / "run" / "recipe.yaml")
    assert _bare_resume(["train", "--resume", recipe, "--plain"]) == ["train", "--resume", str(tmp_path / "run"),
                                                                      "--plain"]
    assert _bare_resume(["train", "--resume", "mine.yaml"]) == ["train", "--resume", "latest", "mine.yaml"]


def test_the_runs_recipe_names_its_data_files_from_anywhere(tmp_path, monkeypatch):
    # A relative data.path was stored as typed: a resume from another directory could not find the data.
    here = tmp_path / "here"
    here.mkdir()
    (here / "pairs.jsonl").write_text('{"source": "one", "target": "un"}\n')
    monkeypatch.chdir(here)
    recipe = load_recipe(None, ["data.source=jsonl", "data.path=pairs.jsonl"])
    run = tmp_path / "run"
    run.mkdir()
    existing.save_recipe(recipe, run)
    assert existing.recipe_changes(recipe, run) == []  # the same file, however it is named
    monkeypatch.chdir(tmp_path)
    resumed = load_recipe(run / "recipe.yaml")
    assert resumed.data.path == str(here / "pairs.jsonl") and resumed.data.tokenizer is None


@pytest.mark.parametrize("holds, line", [
    (("checkpoints/step-00000002", "recipe.yaml"),
     "run: is a run directory, not a recipe file; give --resume run to continue it, or run/recipe.yaml to start "
     "again with its recipe"),
    (("recipe.yaml",), "run: is a run directory, not a recipe file; give run/recipe.yaml to start again with its "
                       "recipe"),  # no checkpoint to continue from
    ((), "run: is a run directory, not a recipe file; give the recipe it was started with"),
])
def test_a_run_directory_given_as_the_recipe_says_how_to_continue_it_or_start_again(tmp_path, monkeypatch, holds,
                                                                                     line):
    # It said only "is a directory, not a recipe file".
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    for name in holds:
        if name == "recipe.yaml":
            (run / name).write_text(recipe_yaml(load_recipe(None)))
        else:
            (run / name).mkdir(parents=True)
    with pytest.raises(UserError) as caught:
        existing.train_recipe("run", [], None, None, "outputs")
    assert str(caught.value) == line


def test_a_set_aside_checkpoint_at_its_end_says_which_steps_a_longer_resume_sets_aside():
    # Its course left the run at step 560: training on from its step 600 sets the run's steps after 560 aside
    # (it said "after 600").
    from gpipe_cli.train.existing import complete_line

    earlier = Path("run/checkpoints/superseded-20261207-004601-at-step-560/step-00000600")
    assert complete_line(Path("run"), 600, "train.steps 600", earlier=earlier).endswith(
        "(raise train.steps to train on from it: the run's steps after 560 are then set aside)")
    kept = Path("run/checkpoints/step-00000004")
    assert complete_line(Path("run"), 4, "train.steps 4", earlier=kept).endswith("steps after 4 are then set aside)")
