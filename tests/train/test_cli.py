"""The command line: bad input is one clear line with exit code 2, and nothing is written."""

import copy
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gpipe_cli.cli import app
from tests.train.recipes import TINY_AMOEBANET, write

runner = CliRunner()


def bad(recipe_changes):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    for key, value in recipe_changes.items():
        section, _, leaf = key.partition(".")
        if leaf:
            recipe.setdefault(section, {})[leaf] = value
        else:
            recipe[section] = value
    return recipe


CASES = {
    "unknown key": (bad({"pipeline.speed": "fast"}), [], "pipeline.speed: unknown key"),
    "wrong type": (bad({"data.batch_size": "lots"}), [],
                   "data.batch_size: must be an integer >= 1 and <= 1048576 (got 'lots')"),
    "K > layers": (bad({"pipeline.partitions": 45}), [], "pipeline.partitions: cannot cut 44 pipeline layers into 45"),
    "M > batch": (bad({"pipeline.microbatches": 32}), [], "pipeline.microbatches (32) must be <= data.batch_size"),
    "missing data path": (bad({"data.source": "imagefolder", "data.path": "/no/such/images"}), [],
                          "data.path: no such file or directory"),
    "malformed --set": (TINY_AMOEBANET, ["--set", "pipeline.partitions"], "--set expects KEY=VALUE"),
    "bad --set value": (TINY_AMOEBANET, ["--set", "pipeline.schedule=zb"], "pipeline.schedule: must be"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_recipes_are_one_line_exit_2_and_write_nothing(tmp_path, case):
    recipe, extra, message = CASES[case]
    out = tmp_path / "out"
    result = runner.invoke(app, ["train", str(write(tmp_path, recipe)), "--output-dir", str(out), *extra])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    # Plain output may already have said what was starting (a plan error comes after the first line).
    assert all(line.startswith("gpipe train ") for line in result.stdout.splitlines()), result.stdout
    assert "Traceback" not in result.output
    assert not out.exists()


def test_empty_recipe_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "the recipe is empty" in result.output


def test_the_installed_command_prints_no_traceback(tmp_path):
    path = write(tmp_path, bad({"pipeline.microbatches": 0}))
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {path}: pipeline.microbatches: must be >= 1 and <= 1048576 (got 0)"
    assert proc.stdout == ""


def test_validate_prints_the_plan_and_writes_json(tmp_path):
    target = tmp_path / "plan.json"
    result = runner.invoke(app, ["validate", str(write(tmp_path, TINY_AMOEBANET)), "--json", str(target)])
    assert result.exit_code == 0, result.output
    assert "theoretical bubble 0.200" in result.output and "stem" in result.output
    plan = json.loads(target.read_text())
    assert plan["total_params"] > 0 and len(plan["stages"]) == 2
    assert sum(len(s["layers"]) for s in plan["stages"]) == 44
    assert all({"layers", "params"} <= set(s) for s in plan["stages"])
    assert plan["recipe"]["pipeline"]["partitions"] == 2
    assert result.output.rstrip().endswith(f"wrote {target}")  # it wrote silently


def test_validate_reads_no_data_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["validate"])
    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == []


def test_a_folder_on_a_read_only_file_system_is_said_to_be_on_one(tmp_path, monkeypatch):
    # "is not writable" sent the user to its permissions, which were not the cause.
    import os
    from types import SimpleNamespace

    monkeypatch.setattr("gpipe_cli.files.os.access", lambda path, mode: False)
    monkeypatch.setattr("gpipe_cli.files.os.statvfs", lambda path: SimpleNamespace(f_flag=os.ST_RDONLY))
    result = runner.invoke(app, ["train", str(write(tmp_path, TINY_AMOEBANET)), "--plain", "--output-dir",
                                 str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --output-dir: '{tmp_path}' is on a read-only file system\n", result.output


def test_an_unwritable_current_folder_is_told_how_to_write_the_run_elsewhere(tmp_path, monkeypatch):
    # It said only that '.' is not writable; a user who named no folder was not told of --output-dir.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gpipe_cli.files.os.access", lambda path, mode: False)  # root may write anyway
    result = runner.invoke(app, ["train", str(write(tmp_path, TINY_AMOEBANET)), "--plain"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: the output directory: '.' is not writable; give --output-dir DIR to write the run "
                     "elsewhere"], result.output
