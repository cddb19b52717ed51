"""The short flags of bench and profile-memory are aliases of recipe keys: the same options, the schema's help."""

from pathlib import Path

import pytest

from gpipe_cli.bench import bench_options
from gpipe_cli.profile import profile_options
from gpipe_cli.recipe.aliases import ALIASES, description, flag
from gpipe_cli.recipe.load import RecipeError

RECIPE = "gpipe_cli/recipe/quickstart.yaml"


@pytest.mark.parametrize("recipe", [None, RECIPE])
def test_a_flag_gives_the_options_its_set_gives(recipe):
    by_flag = bench_options(recipe, {"microbatches": 4, "balance": "1,3"}, [])
    by_set = bench_options(recipe, {}, ["pipeline.microbatches=4", "pipeline.balance=[1, 3]"])
    assert by_flag == by_set and by_flag.microbatches == 4 and by_flag.balance == "1,3"


def test_a_recipe_gives_its_pipeline_batch_and_model():
    options = bench_options(RECIPE, {}, ["model.dropout=0"])
    assert (options.model, options.partitions, options.microbatches, options.batch_size) == (RECIPE, 2, 4, 32)
    assert options.set == ["model.dropout=0"]
    assert bench_options(None, {}, []).partitions == 2  # bench's own, without a recipe


def test_set_means_a_recipe_key_as_in_train():
    with pytest.raises(RecipeError, match=r"^--set dropout: unknown key \(did you mean model.dropout\?\)"):
        bench_options(None, {}, ["dropout=0"])
    with pytest.raises(RecipeError, match=r"^--set pipeline.offload: must be 'none' or 'activations' \(got yes\)"):
        bench_options(None, {}, ["pipeline.offload=yes"])


def test_a_bad_value_is_named_as_typed():
    with pytest.raises(RecipeError, match=r"^--microbatches: must be >= 1"):
        bench_options(RECIPE, {"microbatches": 0}, [])
    # A `--set` item is named as the `--set` it is: the recipe file does not hold the value.
    with pytest.raises(RecipeError, match=r"quickstart.yaml: --set pipeline.microbatches: must be >= 1"):
        bench_options(RECIPE, {}, ["pipeline.microbatches=0"])


@pytest.mark.parametrize("recipe", [None, RECIPE])
def test_a_set_item_comes_after_the_flag_of_its_key(recipe):
    # The flag's name was given to the --set's bad value: `--microbatches: ... (got 'abc')`.
    options = bench_options(recipe, {"microbatches": 4}, ["pipeline.microbatches=2"])
    assert options.microbatches == 2
    assert options.notes == ["--set pipeline.microbatches=2 replaces --microbatches 4"]  # it was silent
    with pytest.raises(RecipeError, match=r"--set pipeline.microbatches: must be an integer"):
        bench_options(recipe, {"microbatches": 4}, ["pipeline.microbatches=abc"])


def test_the_help_of_an_alias_is_the_schemas_description():
    import typer

    from gpipe_cli.cli import app

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    # profile-memory's --partitions is its own (a list of K); plan searches the pipeline, so takes only the sizes.
    for name, least in (("bench", 14), ("profile-memory", 14), ("plan", 10)):
        aliases = [p for p in commands[name].params if p.name in ALIASES and p.opts == [flag(p.name)]
                   and p.help == description(ALIASES[p.name])]
        assert len(aliases) >= least, (name, [p.name for p in aliases])


def test_profile_memory_takes_a_recipe():
    options = profile_options(RECIPE, None, {}, ["pipeline.checkpoint=always"])
    assert (options.model, options.partitions, options.microbatches, options.checkpoint) == (RECIPE, [2], 4, "always")
    assert profile_options(RECIPE, "2,4", {}, []).partitions == [2, 4]
    assert profile_options(None, None, {}, []).partitions == [2, 4, 8]


@pytest.mark.parametrize("shipped", ["recipes/transformer-wmt-en-de.yaml", "recipes/amoebanet-d-cifar10.yaml"])
def test_a_recipes_cut_a_command_does_not_make_is_said_and_its_own_made(shipped):
    # The paper recipes cut by time, which profile-memory does not make: it refused them.
    options = profile_options(shipped, None, {}, [])
    assert options.balance is None and options.notes == [
        "the recipe's pipeline.balance (time) is a cut gpipe profile-memory does not make; it makes its own, as "
        "--balance auto"]
    assert bench_options(shipped, {}, []).notes == []  # bench cuts by time itself
    # Typed, the same mode is refused, as before.
    with pytest.raises(RecipeError, match=r"^--set pipeline.balance: this command cuts by 'auto' or a list"):
        profile_options(shipped, None, {}, ["pipeline.balance=time"])


def test_a_recipes_replicas_are_said_not_to_be_measured(tmp_path):
    # bench ran one pipeline on the whole batch of a recipe with data_parallel 2, and said nothing of it.
    text = Path(RECIPE).read_text().replace("pipeline:\n", "pipeline:\n  data_parallel: 2\n", 1)
    recipe = tmp_path / "dp2.yaml"
    recipe.write_text(text)
    note = "the recipe's pipeline.data_parallel (2) is not read: gpipe {} measures one pipeline, on the whole " \
           "data.batch_size"
    assert bench_options(str(recipe), {}, []).notes == [note.format("bench")]
    assert profile_options(str(recipe), None, {}, []).notes == [note.format("profile-memory")]
    assert bench_options(RECIPE, {}, []).notes == []


def test_a_budget_search_of_a_recipe_says_the_model_is_the_familys():
    # The header showed the paper's widths beside the recipe's M and batch, and nothing said why.
    assert profile_options(RECIPE, None, {}, [], budget="8GiB").notes == [
        "--budget searches the family's layers and width at the paper's other sizes, not the recipe's model; the "
        "recipe gives the pipeline and the batch"]
    assert profile_options(None, None, {}, [], budget="8GiB").notes == []


def test_a_flag_word_that_opens_a_list_is_refused_as_a_word_of_the_flag():
    # As a `--set` item it is YAML left open; a flag takes words, so it is named by the flag as any other word.
    with pytest.raises(RecipeError) as caught:
        bench_options(None, {"schedule": "[a"}, [])
    assert str(caught.value) == ("--schedule: must be 'gpipe', '1f1b', 'interleaved', 'zero-bubble', "
                                 "'zero-bubble-v' or 'v-half' (got '[a')")
