"""The line that says which data a run reads: a key the source does not read is said to be unread."""

from types import SimpleNamespace

from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.train.loop import Trainer

QUICKSTART = "gpipe_cli/recipe/quickstart.yaml"


def line(tmp_path, *sets: str, resume: str | None = None) -> str:
    return Trainer._reading_data(SimpleNamespace(recipe=load_recipe(QUICKSTART, list(sets)), run_dir=tmp_path,
                                                 job=SimpleNamespace(resume=resume)))


def test_a_resume_that_trains_the_tokenizer_again_says_its_file_was_missing(tmp_path):
    # A run's lost tokenizer.model was trained again without a word; the checkpoint knows only the old pieces.
    assert line(tmp_path, resume=str(tmp_path)).endswith(
        "training the tokenizer (vocabulary 512): the run's tokenizer.model is missing; a new one has the same "
        "pieces only if the training text is unchanged")
    assert line(tmp_path).endswith("training the tokenizer (vocabulary 512)")
    (tmp_path / "tokenizer.model").write_bytes(b"kept")
    assert line(tmp_path, resume=str(tmp_path)) == "reading data (synthetic)"


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
