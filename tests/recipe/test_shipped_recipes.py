"""The shipped recipes as a user meets them offline: the commands in their comments work, and hub data fails fast."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpipe_cli.cli import app
from gpipe_cli.data import DataError, build_data_for
from gpipe_cli.data.offline import check_hub_data, suggested_folder
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.train.plan import checked_plan

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
HUB = [p for p in RECIPES if load_recipe(p).data.source == "hub"]
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connection refused at once


def commands(path: Path, verb: str) -> list[list[str]]:
    """The `gpipe <verb> ...` commands written in a recipe's comments, as argument lists."""
    found = re.findall(rf"^#\s+(gpipe {verb} recipes/.*)$", path.read_text(), flags=re.M)
    return [shlex.split(c) for c in found]


def overrides(args: list[str]) -> list[str]:
    """The values of every --set in an argument list."""
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def offline_env(home: Path) -> dict[str, str]:
    """An environment in which the hub cannot be reached and nothing is cached."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_ENDPOINT": UNREACHABLE, "HF_HOME": str(home), "PYTHONPATH": str(ROOT)}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in [k for k in os.environ if k.startswith(("HF_", "HUGGINGFACE_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def test_every_hub_recipe_has_a_cpu_hint_and_prepare_instructions() -> None:
    assert HUB, "no shipped recipe reads the hub"
    for path in HUB:
        rel = f"recipes/{path.name}"
        assert [c[2] for c in commands(path, "train")] == [rel], path.name
        folder = suggested_folder(load_recipe(path).data)
        assert commands(path, "prepare-data") == [["gpipe", "prepare-data", rel, "--output", folder]]
        assert f"--set data.source=parquet --set data.path={folder}" in path.read_text()


@pytest.mark.parametrize("path", HUB, ids=lambda p: p.name)
def test_cpu_hint_validates_and_reads_its_data_offline(path: Path, offline: None) -> None:
    (args,) = commands(path, "train")
    recipe = load_recipe(ROOT / args[2], overrides(args))
    checked_plan(recipe, args[2])
    check_hub_data(recipe.data, args[2])  # no hub needed
    loader = build_data_for(recipe)  # the data is what needs the network; the model is tested elsewhere
    batch = next(loader.train_batches())
    assert batch.size == recipe.data.batch_size or recipe.data.tokens_per_batch is not None
    assert loader.eval_size > 0 and batch.targets is not None and len(batch.targets) == batch.size


@pytest.mark.parametrize("path", HUB, ids=lambda p: p.name)
def test_hub_recipe_offline_says_how_to_prepare_and_point_at_the_data(path: Path, offline: None, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rel = f"recipes/{path.name}"
    recipe = load_recipe(path)
    with pytest.raises(DataError) as err:
        check_hub_data(recipe.data, rel, ["train.steps=3", "data.config=xx"])
    msg = str(err.value)
    assert "\n" not in msg and f"'{recipe.data.name}'" in msg
    prepare = re.search(r"`(gpipe prepare-data [^`]*)`", msg)
    assert prepare is not None
    args = shlex.split(prepare.group(1))
    assert args[2] == rel and "data.config=xx" in overrides(args) and "train.steps=3" not in overrides(args)
    folder = args[args.index("--output") + 1]
    monkeypatch.chdir(tmp_path)
    (tmp_path / folder).mkdir(parents=True)  # what prepare-data writes: a folder of parquet files
    (tmp_path / folder / "train-00000.parquet").write_bytes(b"")
    if recipe.data.eval_split:  # prepare-data writes the split the recipe holds out too
        (tmp_path / folder / f"{recipe.data.eval_split}-00000.parquet").write_bytes(b"")
    pointed = load_recipe(path, re.findall(r"--set (\S+)", msg.split("then add", 1)[1]))
    assert (pointed.data.source, pointed.data.path) == ("parquet", folder)


@pytest.mark.slow
def test_gpipe_train_of_a_hub_recipe_offline_fails_at_once_in_one_line(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", "recipes/amoebanet-d-cifar10.yaml",
                          "--plain"], cwd=ROOT, env=offline_env(tmp_path / "hf"), capture_output=True, text=True,
                         timeout=300)
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "gpipe prepare-data recipes/amoebanet-d-cifar10.yaml --output data/cifar10" in lines[0]
    assert "--set data.source=parquet --set data.path=data/cifar10" in lines[0]
    assert elapsed < 60  # generous for a loaded machine; before the check it took 83 s


def test_gpipe_prepare_data_offline_is_one_line_and_writes_nothing(tmp_path: Path, offline: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    out = CliRunner().invoke(app, ["prepare-data", "recipes/amoebanet-d-cifar10.yaml", "--output",
                                   str(tmp_path / "cifar10")])
    errors = out.stderr.strip().splitlines()  # stdout may show the progress line of the download attempt
    assert out.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error: "), out.output
    assert "'cifar10'" in out.output and not (tmp_path / "cifar10").exists()
