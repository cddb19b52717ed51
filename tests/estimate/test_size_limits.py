"""Sizes beyond what a recipe may hold are one line at once, naming the flag, before any model is built."""

import time

import pytest

from gpipe_cli.cli import run as gpipe
from gpipe_cli.errors import UserError
from gpipe_cli.estimate.subject import resolve, size_limits
from gpipe_cli.recipe.schema import MAX_LAYERS, MAX_SIZE

TINY = ["--model", "transformer", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8",
        "--vocab-size", "64"]
# Generous, so that a loaded machine does not fail it: a refusal takes well under a second (a model of
# that many layers took minutes to describe, and its memory).
QUICK_S = 10.0


def test_the_limits_are_the_recipe_schemas():
    assert size_limits("transformer")["layers"] == (1, MAX_LAYERS)
    assert size_limits("transformer")["d_model"] == (1, MAX_SIZE)
    assert size_limits("amoebanet")["image_size"][0] == 32


@pytest.mark.parametrize("sizes,sets,message", [
    ({"layers": 99999999999}, [], f"--layers: must be >= 1 and <= {MAX_LAYERS} (got 99999999999)"),
    ({}, ["layers=99999999999"], f"--set layers: must be >= 1 and <= {MAX_LAYERS} (got 99999999999)"),
    ({}, ["model.layers=20000"], f"--set model.layers: must be >= 1 and <= {MAX_LAYERS} (got 20000)"),
    ({"seq_len": 0}, [], f"--seq-len: must be >= 1 and <= {MAX_SIZE} (got 0)"),
    # Not a count at all: named as typed, the value in YAML's words (the builder said `--model transformer: layers
    # must be a positive integer (got True)`).
    ({}, ["model.layers=true"], f"--set model.layers: must be an integer >= 1 and <= {MAX_LAYERS} (got true)"),
    ({}, ["model.d_model="], f"--set model.d_model: must be an integer >= 1 and <= {MAX_SIZE} (got null)"),
    ({}, ["model.heads=2.5"], f"--set model.heads: must be an integer >= 1 and <= {MAX_SIZE} (got 2.5)"),
    ({}, ["model.dropout=true"], "--set model.dropout: must be a number in [0, 1) (got true)"),
    ({}, ["model.arch=foo"], "--set model.arch: must be 'encoder-decoder' or 'decoder-only' (got 'foo')"),
    # A rule between two sizes names each as it was set (it said `--model transformer: d_model (32) must be ...`).
    ({"d_model": 32}, ["model.heads=3"], "--d-model (32) must be divisible by --set model.heads (3)"),
    ({}, ["model.heads=5"], "model.d_model (2048) must be divisible by --set model.heads (5)"),
])
def test_a_size_beyond_the_limits_names_its_flag(sizes, sets, message):
    with pytest.raises(UserError) as caught:
        resolve("transformer", sizes, sets)
    assert str(caught.value) == message


def test_a_preset_beyond_the_limits_is_named():
    with pytest.raises(UserError, match=f"^--model transformer-l-99999999: layers: must be >= 1 and <= {MAX_LAYERS}"):
        resolve("transformer-l-99999999")


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("flags", [["--layers", "99999999999"], ["--layers", "2", "--d-model", "99999999999"],
                                   ["--set", "model.layers=50000"]])
def test_the_commands_refuse_a_huge_size_at_once_and_write_nothing(capsys, tmp_path, command, flags):
    out = tmp_path / "figures.json"
    started = time.monotonic()
    assert gpipe([command, *TINY, *flags, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "must be >= 1 and <=" in lines[0], captured
    assert "Traceback" not in captured.err + captured.out
    assert time.monotonic() - started < QUICK_S
    assert list(tmp_path.iterdir()) == []
