"""`gpipe profile-memory --budget` end to end: a huge budget ends, says its bound; --set is honoured or refused."""

import json

import pytest

from gpipe_cli.cli import run as gpipe

TINY = ["--model", "transformer", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8",
        "--vocab-size", "64"]


def test_a_huge_budget_ends_at_the_bound_and_says_the_bound_stopped_it(capsys, tmp_path):
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, "--budget", "100000TiB", "--partitions", "2", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the terminal's width wraps the lines
    assert "Traceback" not in text
    assert "the search stopped at its bound (10000 layers, the most a recipe may have), not at the budget" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["10000"] * 3 and all(r["bound"] for r in rows)


@pytest.mark.parametrize("flags,message", [
    (["--set", "model.colour=red"], "error: --set: unknown parameter 'colour' for the transformer family of --budget"),
    (["--set", "model.layers=3"], "error: --budget searches the layers and filters: drop --set layers"),
    (["--heads", "3"], "error: --budget: d_model (32) must be divisible by heads (3)"),
    (["--d-model", "99999999999"], "error: --d-model: must be >= 1 and <= 1048576 (got 99999999999)"),
])
def test_a_bad_model_flag_of_the_budget_search_is_one_line_and_writes_nothing(capsys, tmp_path, flags, message):
    # --set was dropped without a word: the search ran on the paper's model, not the one asked for.
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, *flags, "--budget", "8GiB", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and "Traceback" not in captured.out, captured
    assert not out.exists()


def test_set_reaches_the_searched_family(capsys, tmp_path):
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, "--set", "model.dropout=0", "--budget", "8MiB", "--partitions", "2",
                  "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fixed"]["dropout"] == 0
