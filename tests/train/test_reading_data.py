"""The line that says which data a run reads: a key the source does not read is said to be unread."""

from types import SimpleNamespace

from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.train.loop import Trainer

QUICKSTART = "gpipe_cli/recipe/quickstart.yaml"


def line(tmp_path, *sets: str) -> str:
    return Trainer._reading_data(SimpleNamespace(recipe=load_recipe(QUICKSTART, list(sets)), run_dir=tmp_path))


def test_the_data_a_source_reads_is_named(tmp_path):
    (tmp_path / "pairs.tsv").write_text("a\tb\n")
    assert line(tmp_path, "data.source=tsv", f"data.path={tmp_path / 'pairs.tsv'}").startswith(
        f"reading data (tsv: {tmp_path / 'pairs.tsv'}) and training the tokenizer")


def test_a_path_synthetic_data_does_not_read_is_said_unread(tmp_path):
    # It read `reading data (synthetic: /nonexistent)`, as if the path were used.
    assert line(tmp_path, "data.path=/nonexistent").startswith(
        "reading data (synthetic; data.path not read by synthetic data)")


def test_a_split_synthetic_data_does_not_hold_out_is_said_unread(tmp_path):
    # An explicit data.eval_split was ignored without a word: synthetic data holds out data.eval_fraction.
    assert line(tmp_path, "data.eval_split=validation").startswith(
        "reading data (synthetic; data.eval_split not read by synthetic data)")
    assert line(tmp_path, "model.arch=decoder-only", "data.source=pydoc", "data.eval_split=test",
                "data.path=/x").startswith(
        "reading data (pydoc; data.path and data.eval_split not read by pydoc data)")
