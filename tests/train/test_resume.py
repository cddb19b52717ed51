"""A resumed run keeps the cut its checkpoint was written with when the recipe leaves the cut to a cost."""

import json

import pytest

from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.train.resume import saved_cut
from tests.train import recipes

LAYERS = 44  # the tiny AmoebaNet (six layers per cell)


def checkpoint(run, step: int, **layout) -> None:
    """A whole checkpoint folder (no files besides its manifest) with the given layout in its manifest."""
    folder = run / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    manifest = {"step": step, "files": {}, "checksums": {}, "partitions": 2, "data_parallel": 1, **layout}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def recipe(tmp_path, *overrides: str):
    return load_recipe(str(recipes.write(tmp_path, recipes.TINY_AMOEBANET)), list(overrides))


@pytest.mark.parametrize("balance", ["auto", "time", "memory"])
def test_a_cut_chosen_by_cost_is_kept_from_the_newest_checkpoint(tmp_path, balance):
    run = tmp_path / "run"
    checkpoint(run, 3, balance=[7, 37])
    checkpoint(run, 6, balance=[25, 19])
    wanted = recipe(tmp_path, f"pipeline.balance={balance}")
    assert saved_cut(str(run), wanted, LAYERS) == [25, 19]
    assert saved_cut(str(run / "checkpoints" / "step-00000003"), wanted, LAYERS) == [7, 37]


@pytest.mark.parametrize(("overrides", "layout"), [
    (["pipeline.balance=[19, 25]"], {"balance": [25, 19]}),           # the user's own cut
    (["pipeline.balance=params"], {"balance": [25, 19]}),           # the same on every launch anyway
    (["pipeline.partitions=3"], {"balance": [25, 19]}),             # another K
    ([], {"balance": [25, 19], "data_parallel": 2}),                # another D
    ([], {"balance": [25, 18]}),                                    # not this model's layers
    ([], {"balance": [25, 19, 0]}),
    ([], {"balance": "25,19"}),
])
def test_otherwise_the_cut_is_chosen_again(tmp_path, overrides, layout):
    run = tmp_path / "run"
    checkpoint(run, 3, **layout)
    assert saved_cut(str(run), recipe(tmp_path, *overrides), LAYERS) is None


def test_no_whole_checkpoint_no_saved_cut(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000003").mkdir(parents=True)  # no manifest: the save did not finish
    assert saved_cut(str(run), recipe(tmp_path), LAYERS) is None


def test_a_checkpoint_of_a_version_before_holding_out_by_content_is_told_apart():
    # A text run of an earlier version, resumed, trained on another split in another order without a word.
    from gpipe_cli.train.resume import split_rule_changed

    content = {"train_examples": 1_100, "held_out": 55, "held_out_by": "content"}
    assert split_rule_changed(None, content) and split_rule_changed([], content)
    assert not split_rule_changed({"train_examples": 1_100, "held_out": 55}, content)  # counted: the same rule
    assert not split_rule_changed(None, {"train_examples": 1_100, "held_out": 55})  # a split given, or synthetic


def test_a_data_change_is_said_only_for_counts_a_checkpoint_recorded_and_that_moved():
    from gpipe_cli.train.resume import data_change

    now = {"train_examples": 1_100, "held_out": 55}
    assert data_change(None, now) == "" and data_change({}, now) == ""  # a checkpoint of an older version
    assert data_change(dict(now), now) == "" and data_change({"train_examples": 1_000}, {}) == ""
    assert data_change({"train_examples": 1_000, "held_out": 55}, now) == "training examples 1,000 then, 1,100 now"
    assert data_change({"train_examples": 1_100, "held_out": "x"}, now) == ""  # an edited manifest: nothing to say


def test_a_final_evaluation_is_missing_only_where_the_run_holds_data_out_and_has_no_record_of_it(tmp_path):
    from gpipe_cli.train.existing import final_eval_missing

    quickstart = load_recipe(None)
    plain, evaluating = (quickstart.model_copy(update={"eval": quickstart.eval.model_copy(update={"every": every})})
                         for every in (None, 5))
    assert final_eval_missing(tmp_path, 10, plain, held=3)  # no records at all, and data held out
    assert not final_eval_missing(tmp_path, 10, evaluating, held=0)  # nothing held out: nothing to evaluate
    assert final_eval_missing(tmp_path, 10, evaluating) and not final_eval_missing(tmp_path, 10, plain)  # older
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 10, "loss": 1.0}) + "\n")
    assert not final_eval_missing(tmp_path, 10, plain, held=3)
    assert final_eval_missing(tmp_path, 12, plain, held=3) and final_eval_missing(tmp_path, 12, plain)


def test_a_resume_of_a_run_whose_checkpoints_were_renamed_names_them_instead_of_starting_again(tmp_path):
    # "there are no checkpoints there; start it again from step 0" of a run holding good-one/, renamed by hand.
    from gpipe_cli.train.existing import no_usable

    kept = tmp_path / "run" / "checkpoints" / "good-one"
    kept.mkdir(parents=True)
    (kept / "manifest.json").write_text("{}")
    assert str(no_usable(str(tmp_path / "run"), [])) == (
        f"--resume {tmp_path / 'run'}: no usable checkpoint (there are no checkpoints there); "
        f"'{tmp_path / 'run' / 'checkpoints'}' holds 'good-one', not named step-*: resume one by its path")


def test_a_checkpoint_past_eight_digits_of_steps_is_the_newest(tmp_path):
    from gpipe_cli.runs import candidates

    for step in (99_999_999, 100_000_000, 5):
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    assert [p.name for p in candidates(tmp_path)] == ["step-100000000", "step-99999999", "step-00000005"]
