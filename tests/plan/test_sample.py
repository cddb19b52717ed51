"""The plan times layers on the recipe's own mini-batches, not on examples of full length."""

from gpipe_cli.plan.sample import typical_batch
from gpipe_cli.recipe.load import load_recipe


def test_the_quick_start_is_timed_on_its_short_sentences_and_micro_batches_keep_their_shape():
    recipe = load_recipe(None)
    sample = typical_batch(recipe)
    source, target_in = sample.inputs
    assert sample.examples == recipe.data.batch_size
    assert source.shape[1] < recipe.model.max_len and target_in.shape[1] < recipe.model.max_len
    assert sample.build_seconds > 0 and "median" in sample.note
    (part_source, part_target), part_labels = sample.take(4)
    assert part_source.shape == (4, source.shape[1]) and part_labels.shape == (4, sample.targets.shape[1])


def test_data_that_cannot_be_read_here_leaves_generated_examples_and_says_why(monkeypatch):
    from gpipe_cli.plan import runner, sample

    def unreadable(recipe):
        raise OSError("the hub is unreachable")

    monkeypatch.setattr(sample, "typical_batch", unreadable)
    said = []
    assert runner._sample(load_recipe(None), said.append) is None
    assert "could not be read here (the hub is unreachable)" in said[-1]


def test_why_the_data_cannot_be_read_is_said_whole_with_its_fix(monkeypatch):
    from gpipe_cli.plan import runner, sample

    why = ("cannot download dataset wmt14 (de-en) from the Hugging Face hub: " + "no route to host; " * 12
           + "prepare it where the hub is reachable (gpipe prepare-data RECIPE --output DIR writes it) and set "
           "data.path to DIR")

    def offline(recipe):
        raise OSError(why + "\nsecond line of detail")

    monkeypatch.setattr(sample, "typical_batch", offline)
    said = []
    assert runner._sample(load_recipe(None), said.append) is None
    assert len(why) > 200 and f"({why})" in said[-1] and "\n" not in said[-1]
