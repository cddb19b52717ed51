"""`gpipe export` of odd arguments: one line naming what is wrong, exit code 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpipe_cli.cli import run
from tests.train.test_checkpoint import save_one


def one_error_line(code: int, err: str, out: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err[-2000:], out[-2000:])
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err + out
    return lines[0]


@pytest.mark.parametrize(("target", "fragment"), [
    ("nowhere", "error: no such run directory or checkpoint: '"),
    ("", "error: RUN: an empty path names no run; give the folder gpipe train wrote"),  # as every command says it
    ("recipe.yaml", "is a file; give a run directory or one of its checkpoint folders"),
], ids=["missing", "empty", "a file"])
def test_a_run_argument_that_is_no_run_is_named_in_one_line(tmp_path, monkeypatch, capsys, target, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text("name: a\n")
    before = sorted(tmp_path.rglob("*"))
    code = run(["export", target])
    captured = capsys.readouterr()
    assert fragment in one_error_line(code, captured.err, captured.out)
    assert sorted(tmp_path.rglob("*")) == before


def test_an_output_that_is_a_directory_is_refused_before_the_checkpoint_is_read(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    save_one(run_dir, 2, value=1.0)
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr("gpipe_cli.train.checkpoint.newest_whole",
                        lambda *args, **kwargs: pytest.fail("the checkpoint was read first"))
    before = sorted(tmp_path.rglob("*"))
    code = run(["export", str(run_dir), "--output", str(tmp_path / "folder")])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert line.startswith("error: --output: cannot write '") and "it is a directory; name a file, e.g. '" in line
    assert sorted(tmp_path.rglob("*")) == before


def test_another_runs_own_export_is_not_replaced(tmp_path, monkeypatch, capsys):
    # It was, and gpipe predict of that run then took the weights for its own, of a step it never trained.
    save_one(tmp_path / "a", 2, value=1.0)
    save_one(tmp_path / "b", 7, value=2.0)
    (tmp_path / "b" / "model.safetensors").write_bytes(b"b's own")
    monkeypatch.chdir(tmp_path)
    code = run(["export", "a", "--output", "b/model.safetensors"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        "error: --output 'b/model.safetensors' is the export another run keeps for gpipe predict; name another file, "
        "or leave --output out to write the run's own")
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == b"b's own"
    assert run(["export", "a/checkpoints/step-00000002", "--output", "a/model.safetensors"]) == 0  # its own
    (tmp_path / "link").symlink_to(tmp_path / "a")
    monkeypatch.chdir(tmp_path / "a" / "checkpoints")  # its own by another name, or from inside it
    assert run(["export", "step-00000002", "--output", "../model.safetensors"]) == 0
    assert run(["export", "../../link", "--output", "../model.safetensors"]) == 0


def test_a_run_folder_without_checkpoints_says_so(tmp_path: Path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n')
    code = run(["export", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert "no complete checkpoint to export" in one_error_line(code, captured.err, captured.out)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]


def test_a_folder_that_is_no_run_is_said_so_as_resume_says_it(tmp_path: Path, capsys):
    # It was "no complete checkpoint to export (there are no checkpoints)" for any folder at all.
    (tmp_path / "empty").mkdir()
    code = run(["export", str(tmp_path / "empty")])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: {tmp_path / 'empty'}: not a run directory (no recipe.yaml, metrics.jsonl or checkpoints); give a "
        "folder gpipe train wrote, or one of its checkpoint folders")
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_folder_holding_a_recipe_alone_is_not_said_to_lack_it(tmp_path: Path, capsys):
    # It said "no recipe.yaml, metrics.jsonl or checkpoints" of a folder holding recipe.yaml.
    (tmp_path / "set-up").mkdir()
    (tmp_path / "set-up" / "recipe.yaml").write_text("name: x\n")
    code = run(["export", str(tmp_path / "set-up")])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: {tmp_path / 'set-up'}: not a run directory (no metrics.jsonl or checkpoints); give a folder gpipe "
        "train wrote, or one of its checkpoint folders")


def test_a_checkpoints_folder_that_cannot_be_read_is_said_so(tmp_path, monkeypatch, capsys):
    # It was "there are no checkpoints".
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr("gpipe_cli.train.export.os.access", lambda path, mode: False)
    code = run(["export", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: {tmp_path / 'run'}: cannot read '{tmp_path / 'run' / 'checkpoints'}' (permission denied)")


def test_an_output_that_is_a_symbolic_link_is_refused_not_replaced(tmp_path, capsys):
    run_dir = tmp_path / "run"
    save_one(run_dir, 2, value=1.0)
    (tmp_path / "target.safetensors").write_bytes(b"kept")
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "target.safetensors")
    code = run(["export", str(run_dir), "--output", str(tmp_path / "link.safetensors")])
    captured = capsys.readouterr()
    assert "it is a symbolic link" in one_error_line(code, captured.err, captured.out)
    assert (tmp_path / "link.safetensors").is_symlink() and (tmp_path / "target.safetensors").read_bytes() == b"kept"


def test_a_run_whose_only_checkpoint_is_damaged_is_one_line_with_the_reason(tmp_path, capsys):
    save_one(tmp_path, 3, value=1.0)
    data = next(p for p in (tmp_path / "checkpoints" / "step-00000003").iterdir() if p.suffix == ".distcp")
    data.write_bytes(b"short")
    code = run(["export", str(tmp_path)])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert "no complete checkpoint to export (step-00000003: " in line and data.name in line
    assert "using the one before it" not in captured.err


def test_a_full_disk_is_one_line_naming_the_flag_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    # safetensors says it in its own error, which was a traceback: "I/O error: No space left on device (os error 28)".
    from safetensors import SafetensorError

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    save_one(tmp_path / "run", 2, value=1.0)
    (tmp_path / "out").mkdir()
    code = run(["export", str(tmp_path / "run"), "--output", str(tmp_path / "out" / "model.safetensors")])
    err = capsys.readouterr().err  # after a line that the run has no recipe.yaml: the weights alone are exported
    target = tmp_path / "out" / "model.safetensors"
    assert code == 2 and "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [
        f"error: --output: cannot write {str(target)!r} (No space left on device)"], err
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("target", ["recipe.yaml", "metrics.jsonl", "tokenizer.model", "checkpoints/model.safetensors",
                                    "checkpoints/step-00000002/model.safetensors", "sub/../recipe.yaml"])
@pytest.mark.parametrize("given", ["run", "checkpoint"])
def test_an_output_that_is_one_of_the_runs_own_files_is_refused_before_the_checkpoint_is_read(
        tmp_path, monkeypatch, capsys, target, given):
    # `--output RUN/recipe.yaml` wrote safetensors over the run's recipe, and the run could no longer resume.
    run_dir = tmp_path / "run"
    save_one(run_dir, 2, value=1.0)
    (run_dir / "recipe.yaml").write_text("name: r\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (run_dir / "sub").mkdir()
    monkeypatch.setattr("gpipe_cli.train.checkpoint.newest_whole",
                        lambda *args, **kwargs: pytest.fail("the checkpoint was read first"))
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    location = run_dir if given == "run" else run_dir / "checkpoints" / "step-00000002"
    code = run(["export", str(location), "--output", str(run_dir / target)])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    what = "is inside the run's checkpoints/" if target.startswith("checkpoints") else \
        f"is the run's {Path(target).name}: writing there would replace it"
    assert line.startswith(f"error: --output {str(run_dir / target)!r} {what}"), line
    assert line.endswith(f"name another file, e.g. {str(run_dir / 'model.safetensors')!r}"), line
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_an_existing_file_that_is_not_the_runs_is_still_replaced(tmp_path, capsys):
    run_dir = tmp_path / "run"
    save_one(run_dir, 2, value=1.0)
    (run_dir / "notes.safetensors").write_bytes(b"old")
    assert run(["export", str(run_dir), "--output", str(run_dir / "notes.safetensors")]) == 0
    assert f"wrote {run_dir / 'notes.safetensors'}" in capsys.readouterr().out
    assert (run_dir / "notes.safetensors").read_bytes() != b"old"


@pytest.mark.parametrize("target", ["recipe.yaml", "metrics.jsonl", "checkpoints/step-00000002/manifest.json",
                                    "checkpoints"])
@pytest.mark.parametrize("command", [["validate", "--json"], ["export", "OTHER", "--output"], ["report", "OTHER",
                                                                                             "--output"]])
def test_no_command_writes_over_a_file_another_run_keeps(tmp_path, capsys, command, target):
    # `gpipe export run1 --output lm/checkpoints/step-00000010/.metadata` left lm with a checkpoint it refused.
    other, run_dir = tmp_path / "other", tmp_path / "run"
    save_one(other, 2, value=1.0)
    (other / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    save_one(run_dir, 2, value=1.0)
    (run_dir / "recipe.yaml").write_text("name: r\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = {p: p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")}
    code = run([str(other) if arg == "OTHER" else arg for arg in command] + [str(run_dir / target)])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert f"{str(run_dir / target)!r} is " in line and f"name another file, e.g. '{run_dir}/" in line
    assert {p: p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")} == before


def test_a_folder_named_checkpoints_that_holds_no_run_is_written_to(tmp_path, capsys, monkeypatch):
    # A project's own checkpoints/ (another tool's) is not a run's: only one beside a run's records is kept.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert run(["validate", "--json", "checkpoints/plan.json"]) == 0
    assert (tmp_path / "checkpoints" / "plan.json").is_file()


def test_a_link_into_a_runs_checkpoints_is_refused_as_the_folder_itself(tmp_path, capsys, monkeypatch):
    # Refused by name only, `ck/m.safetensors` (ck -> run/checkpoints) wrote into the run's checkpoints.
    monkeypatch.chdir(tmp_path)
    save_one(tmp_path / "run", 2, value=1.0)
    (tmp_path / "ck").symlink_to(tmp_path / "run" / "checkpoints")
    assert run(["export", "run", "--output", "ck/m.safetensors"]) == 2
    assert "is inside the run's checkpoints/" in capsys.readouterr().err
    assert run(["train", "--output-dir", "ck/new", "--dry-run"]) == 2
    assert "is inside the run's checkpoints/" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_command_may_write_again_the_file_it_wrote_though_it_is_named_metrics_jsonl(tmp_path, monkeypatch):
    # A folder is a run by its records or step checkpoints, not by a file's name: the second write was refused.
    monkeypatch.chdir(tmp_path)
    assert run(["validate", "--json", "metrics.jsonl"]) == 0
    assert run(["validate", "--json", "metrics.jsonl"]) == 0


@pytest.mark.parametrize("name", ["mine.yaml", "plan.JSON", "records.jsonl", "report.png"])
def test_an_output_named_as_a_text_file_is_refused_and_the_file_kept(tmp_path, capsys, monkeypatch, name):
    # `gpipe export run --output recipes/mine.yaml` replaced the user's recipe with the weights.
    run_dir = tmp_path / "run"
    save_one(run_dir, 2, value=1.0)
    (tmp_path / name).write_text("name: mine\n")
    monkeypatch.setattr("gpipe_cli.train.checkpoint.newest_whole",
                        lambda *args, **kwargs: pytest.fail("the checkpoint was read first"))
    code = run(["export", str(run_dir), "--output", str(tmp_path / name)])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    stem = name.split(".")[0]
    assert line.startswith(f"error: --output {str(tmp_path / name)!r} has a") and (
        f"name, and --output writes safetensors; name a .safetensors file, e.g. "
        f"{str(tmp_path / (stem + '.safetensors'))!r}") in line, line
    assert (tmp_path / name).read_text() == "name: mine\n"


@pytest.mark.parametrize("given", ["course", "checkpoint"])
def test_a_course_a_resume_set_aside_is_exported_beside_the_runs_model_not_over_it(tmp_path, capsys, given):
    # `gpipe export RUN/checkpoints/superseded-...` replaced RUN/model.safetensors, the export of the course the run
    # went on with, with the abandoned course's weights, and said nothing.
    import torch
    from safetensors.torch import load_file

    from gpipe_cli.train import checkpoint

    run_dir = tmp_path / "run"
    save_one(run_dir, 2, value=1.0)
    save_one(run_dir, 4, value=2.0)  # the course a resume from step 2 leaves
    aside = checkpoint.set_aside_newer(run_dir, 2, "20261202-101010")
    assert aside is not None
    save_one(run_dir, 3, value=3.0)  # the course the run goes on with
    assert run(["export", str(run_dir)]) == 0
    own = (run_dir / "model.safetensors").read_bytes()
    location = aside if given == "course" else aside / "step-00000004"
    assert run(["export", str(location)]) == 0
    target = run_dir / "model-superseded-20261202-101010-at-step-2.safetensors"
    assert f"wrote {target}\n" in capsys.readouterr().out
    assert torch.all(load_file(str(target))["weight"] == 2.0)
    assert (run_dir / "model.safetensors").read_bytes() == own


def test_a_run_directory_that_cannot_take_the_export_points_to_output(tmp_path, monkeypatch, capsys):
    # It said only "cannot write" of a read-only run directory, where --output is the way on.
    from safetensors import SafetensorError

    def read_only(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")

    monkeypatch.setattr("safetensors.torch.save_file", read_only)
    save_one(tmp_path / "run", 2, value=1.0)
    code = run(["export", str(tmp_path / "run")])
    err = capsys.readouterr().err
    target = tmp_path / "run" / "model.safetensors"
    assert code == 2 and [line for line in err.splitlines() if "error" in line] == [
        f"error: cannot write {str(target)!r} (Permission denied); write it elsewhere with --output FILE"], err
