"""The plan says per stage whether it fits the machine; train refuses one that cannot, before any rank starts."""

import pytest
from rich.console import Console

from gpipe_cli import memory_model as mm
from gpipe_cli.errors import UserError
from gpipe_cli.models.describe import describe
from gpipe_cli.pipeline import partition, schedules
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.recipe_model import model_spec, optimizer_name
from gpipe_cli.train import run as train_run
from gpipe_cli.train.plan import make_plan, microbatch_size, plan_table, resolve_balance
from gpipe_cli.units import human_bytes
from tests.train import recipes


@pytest.fixture
def recipe_path(tmp_path):
    return recipes.write(tmp_path, recipes.TINY_AMOEBANET)


def test_a_plan_fits_a_large_machine_and_not_a_tiny_one(recipe_path):
    recipe = load_recipe(str(recipe_path), [])
    roomy = make_plan(recipe, device="cpu", available=1e15)
    assert roomy.fits and roomy.misfit() == ""
    cramped = make_plan(recipe, device="cpu", available=1e5)
    assert not cramped.fits and not any(s.fits for s in cramped.stages)
    assert "does not fit this machine" in cramped.misfit() and "stage 0 needs" in cramped.misfit()
    # The ranks share the CPU's RAM: each gets an equal part.
    assert cramped.stages[0].capacity == pytest.approx(1e5 / 2, abs=1)
    assert cramped.to_json()["fits"] is False
    assert str(plan_table(cramped).caption).endswith("): 2 stages of 2 do not fit")  # it said "2 stage(s)"
    assert str(plan_table(roomy).caption).endswith("): every stage fits")
    # Past two stages, the fullest is named and the others counted, so that the advice stays on the one line.
    many = make_plan(load_recipe(str(recipe_path), ["pipeline.partitions=3", "pipeline.balance=params"]), device="cpu",
                     available=1e5)
    text = many.misfit()
    assert "3 of 3 stages are over, stage " in text and text.count(" needs ") == 1, text
    assert text.endswith("choose a smaller model or a larger machine") and len(text) < 400, text
    # Where activations, not weights, are over, the advice is what lowers them.
    roomier = make_plan(load_recipe(str(recipe_path), ["pipeline.partitions=3", "pipeline.balance=params"]),
                        device="cpu", available=1e6)
    assert roomier.misfit().endswith("or set pipeline.checkpoint: always") and len(roomier.misfit()) < 400
    # Remat already on everywhere is not advised again.
    remat = make_plan(load_recipe(str(recipe_path), ["pipeline.partitions=3", "pipeline.balance=params",
                                                     "pipeline.checkpoint=always"]), device="cpu", available=1e6)
    assert remat.misfit().endswith("raise pipeline.microbatches or pipeline.partitions"), remat.misfit()


def test_a_stage_whose_weights_alone_are_over_is_not_told_to_lower_its_batch(recipe_path):
    # A smaller batch, more micro-batches or remat lower activations only: they were advised all the same.
    lopsided = load_recipe(str(recipe_path), ["pipeline.balance=[40, 4]"])
    stages = make_plan(lopsided, device="cpu", available=1e15).stages
    weights = [s.memory.params + s.memory.grads + s.memory.optimizer for s in stages]
    # Room for all the weights on two ranks, not for stage 0's on one: another cut can help.
    text = make_plan(lopsided, device="cpu", available=sum(weights) * 1.2).misfit()
    assert f"alone need {human_bytes(weights[0])} on stage 0 of this cut: set pipeline.balance: auto" in text, text
    assert "Lower data.batch_size" not in text
    # No room for them on all the ranks: only a smaller model or a larger machine can help on a CPU,
    text = make_plan(lopsided, device="cpu", available=sum(weights) * 0.8).misfit()
    assert text.endswith("choose a smaller model or a larger machine"), text
    # and more ranks on GPUs, each with its own memory.
    gpus = make_plan(lopsided, device="cuda", available=sum(weights) * 0.4).misfit()
    assert gpus.endswith(f"raise pipeline.partitions (all stages' {human_bytes(sum(weights))} is 3 ranks' worth)"), gpus
    # A stage of one layer too heavy for its device: no cut and no more devices lighten it.
    each = load_recipe(str(recipe_path), ["pipeline.partitions=44"])
    heaviest = max(s.memory.params + s.memory.grads + s.memory.optimizer
                   for s in make_plan(each, device="cuda", available=1e15).stages)
    text = make_plan(each, device="cuda", available=heaviest * 0.9).misfit()
    assert text.endswith("choose a smaller model or a larger machine"), text


def test_offloaded_activations_count_against_the_host_memory(recipe_path, monkeypatch):
    cut = ["pipeline.checkpoint=never", "pipeline.balance=[25, 19]"]
    recipe = load_recipe(str(recipe_path), ["pipeline.offload=activations", *cut])
    kept = make_plan(load_recipe(str(recipe_path), cut), device="cpu", available=1e15)
    moved = make_plan(recipe, device="cpu", available=1e15)
    assert all(m.memory.host > 0 and m.memory.activations < k.memory.activations
               for k, m in zip(kept.stages, moved.stages))
    # validate and train's plan show the host bytes beside (they showed nothing of them while all fitted).
    console = Console(width=250, record=True)
    console.print(plan_table(moved))
    shown = console.export_text()
    assert "offloaded to host" in shown and "activations offloaded to host memory" in shown
    assert all(human_bytes(m.memory.host) in shown for m in moved.stages)
    kept_shown = Console(width=250, record=True)
    kept_shown.print(plan_table(kept))
    assert "offloaded" not in kept_shown.export_text()
    # On the CPU the host copies share the RAM with the rest; on a GPU they need the host's share of it.
    cramped = make_plan(recipe, device="cpu", available=2 * moved.stages[0].memory.total)
    assert not cramped.stages[0].fits and "offloaded" in cramped.misfit()
    monkeypatch.setattr("gpipe_cli.memory_model.available_bytes", lambda device: 1000)
    gpu = make_plan(recipe, device="cuda", available=1e15)
    assert not gpu.fits and "to host memory" in gpu.misfit() and "over its share of the RAM (500 B)" in gpu.misfit()


def test_estimates_grow_with_the_batch(recipe_path):
    small = make_plan(load_recipe(str(recipe_path), []), available=1e15)
    large = make_plan(load_recipe(str(recipe_path), ["data.batch_size=64"]), available=1e15)
    assert all(b.memory.activations > a.memory.activations for a, b in zip(small.stages, large.stages))


def test_a_tied_weight_is_one_tensor_on_one_stage_and_said_where_each_stage_holds_a_copy(tmp_path):
    # At K=1 the stage's params counted the embedding twice; at K=2 the rows added up past the total unexplained.
    path = recipes.write(tmp_path, recipes.TINY_TRANSLATION)  # tie_embeddings: true
    one = make_plan(load_recipe(str(path), ["pipeline.partitions=1"]), available=1e15)
    assert one.stages[0].params == one.total_params
    assert one.stages[0].memory.params == one.total_params * mm.PARAM_BYTES
    two = make_plan(load_recipe(str(path), []), available=1e15)
    table = 32 * 512  # d_model x vocab_size
    assert sum(s.params for s in two.stages) == two.total_params + table
    assert "each stage holds its own copy of a tied weight" in str(plan_table(two).caption)
    assert "tied" not in str(plan_table(one).caption)


@pytest.mark.parametrize("schedule", ["v-half", "zero-bubble-v", "interleaved"])
@pytest.mark.parametrize("balance", ["[1, 2, 2, 1]", "auto"])
def test_each_stage_names_the_layers_the_engine_places_on_it(tmp_path, schedule, balance):
    # Under a V the table named the layers laid out the interleaved way: embed and the decoders on stage 0.
    path = recipes.write(tmp_path, recipes.TINY_TRANSLATION)  # embed, encoder_1, encoder_2, decoder_1, ...
    recipe = load_recipe(str(path), [f"pipeline.schedule={schedule}", "pipeline.virtual_stages=2",
                                     "pipeline.microbatches=4", f"pipeline.balance={balance}"])
    plan = make_plan(recipe, available=1e15)
    names = [layer.name for layer in describe(model_spec(recipe), plan.microbatch_size).layers]
    placed = schedules.get(schedule).placement  # as the engine's configuration reads it
    for s, stage in enumerate(plan.stages):
        held = partition.stage_layers(plan.balance, 2, s, placed)
        assert stage.layers == [names[i] for i in held]
        assert plan.to_json()["stages"][s]["layers"] == stage.layers
    if schedule != "interleaved":  # a V's stage 0 holds the first and the last chunk
        assert plan.stages[0].layers[0] == "embed" and plan.stages[0].layers[-1] == "softmax"


def test_a_token_budget_is_priced_as_the_full_length_examples_it_bounds(tmp_path):
    # It priced data.batch_size examples of max_len, which a budget does not use: 24 times the tokens of the
    # wmt recipe's CPU trial, and advised lowering data.batch_size.
    path = recipes.write(tmp_path, recipes.TINY_TRANSLATION)  # max_len 40, M=3, batch_size 10
    budget = load_recipe(str(path), ["data.batch_size=500", "data.tokens_per_batch=200"])
    assert microbatch_size(budget) == 2  # 200 / 40 = 5 examples of max_len, in 3 micro-batches
    few = load_recipe(str(path), ["data.batch_size=500", "data.tokens_per_batch=40"])
    assert microbatch_size(few) == 1  # a budget batch still holds one example per micro-batch
    priced = make_plan(budget, available=1e15)
    plain = make_plan(load_recipe(str(path), ["data.batch_size=5"]), available=1e15)
    assert [s.memory.total for s in priced.stages] == [s.memory.total for s in plain.stages]
    cramped = make_plan(budget, available=1.8e6)  # room for any cut's weights, not for its activations
    assert "Lower data.tokens_per_batch" in cramped.misfit()


def test_a_text_models_table_says_its_activations_are_priced_at_full_length(tmp_path, recipe_path):
    # validate priced the quick start's stages at 9.2 and 13.5 MiB of activations; training measured 2.9 and 5.4.
    (tmp_path / "text").mkdir()
    text = make_plan(load_recipe(str(recipes.write(tmp_path / "text", recipes.TINY_TRANSLATION)), []),
                     available=1e15)
    caption = str(plan_table(text).caption).splitlines()[0]
    assert caption.endswith("; activations priced at examples of model.max_len, 40 tokens (shorter ones hold less)")
    images = make_plan(load_recipe(str(recipe_path), []), available=1e15)
    assert "max_len" not in str(plan_table(images).caption)


@pytest.mark.parametrize("balance", ["auto", "[25, 19]"])
def test_train_refuses_a_plan_that_cannot_fit_before_starting_ranks(recipe_path, monkeypatch, balance):
    monkeypatch.setattr("gpipe_cli.memory_model.available_bytes", lambda device: 1000)
    monkeypatch.setattr(train_run, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(UserError, match="does not fit this machine") as caught:
        train_run.train(train_run.TrainOptions(str(recipe_path), [f"pipeline.balance={balance}"]))
    line = str(caught.value)
    assert UserError.exit_code == 2 and "\n" not in line and "each rank has 500 B" in line
    if balance == "auto":  # no cut at all fits: the smallest peak any cut reaches, against what a rank has
        assert ("no cut of the 44 pipeline layers into 2 stages fits; the smallest per-stage peak any cut reaches "
                "is") in line
    else:
        assert "stage 1 needs" in line


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny recipe, its layer summary and its memory figures (slow to compute: shared)."""
    recipe = load_recipe(str(recipes.write(tmp_path_factory.mktemp("tiny"), recipes.TINY_AMOEBANET)), [])
    spec = model_spec(recipe)
    return recipe, describe(spec, microbatch_size(recipe)), mm.measure(spec, recipe.seed, device="meta")


def stage_memory(tiny, capacity: float) -> mm.CutMemory:
    """The stages' memory as the plan prices it (the tiny recipe: one replica, GPipe)."""
    recipe, _, figures = tiny
    pipe = recipe.pipeline
    return mm.CutMemory(figures, pipe.partitions, recipe.data.batch_size, pipe.microbatches, pipe.schedule,
                        pipe.checkpoint, mm.bytes_per_parameter(optimizer_name(recipe)), capacity)


def needs(memory: mm.CutMemory, balance: list[int]) -> list[float]:
    return [memory.need(s, r.start, r.stop) for s, r in enumerate(partition.stage_ranges(balance))]


def test_auto_moves_the_cut_to_fit_memory(tiny):
    recipe, summary, _ = tiny
    roomy = stage_memory(tiny, float("inf"))
    free, by, _ = resolve_balance(recipe, summary, memory=roomy)
    fastest = max(needs(roomy, free))
    leanest, _ = roomy.least()
    assert leanest < fastest  # the tiny model has a cut that needs less than the balanced one
    tight = stage_memory(tiny, (leanest + fastest) / 2)
    balance, tight_by, refusal = resolve_balance(recipe, summary, memory=tight)
    assert balance != free and max(needs(tight, balance)) <= tight.capacity and refusal == ""
    assert tight_by == f"{by}, the fastest cut that fits memory"
    explicit = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"balance": free})})
    assert resolve_balance(explicit, summary, memory=tight)[:2] == (free, "pipeline.balance")  # the user's cut stands


def test_the_plan_says_what_the_cut_was_balanced_by(tiny):
    recipe, summary, _ = tiny

    def mode(balance):
        return recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"balance": balance})})

    assert resolve_balance(recipe, summary)[1] == "estimated FLOPs (gpipe train measures time at launch)"
    costs = [1.0] * 8 + [9.0]
    measured = resolve_balance(recipe, summary, costs, "measured time, cached")
    assert measured[:2] == (partition.balance_by_cost(costs, 2), "measured time, cached")
    assert resolve_balance(mode("time"), summary)[1] == "estimated FLOPs (gpipe train measures time at launch)"
    assert resolve_balance(mode("time"), summary, costs, "measured time")[:2] == (measured[0], "measured time")
    assert resolve_balance(mode("params"), summary, costs)[1] == "parameters"
    why = "estimated FLOPs: measuring failed (RuntimeError: the device is busy)"
    fallback = resolve_balance(recipe, summary, None, why)
    assert fallback[:2] == (resolve_balance(recipe, summary)[0], why)
    alone = recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"partitions": 1})})
    assert resolve_balance(alone, summary)[:2] == ([len(summary.layers)], "the only cut")  # nothing to measure


@pytest.mark.parametrize("width", [60, 80])
def test_validates_plan_table_shows_every_figure_whole_on_a_narrow_terminal(monkeypatch, capsys, width):
    # At 80 columns the headers read `GFLOPs/ex…` and `activatio…`; at 60 figures were cut too (`462.3…`).
    import re

    from gpipe_cli.cli import run
    from tests.widths import problems

    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    assert run(["validate", "recipes/quickstart.yaml"]) == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    table = text[text.index("t-2-512-4: "):]
    assert not problems(table, width), table
    for figure in ("462.34K", "594.94K", "0.038", "0.057", "16.3 MiB", "13.5 MiB", "encoder_2", "softmax"):
        assert figure in table, (figure, table)


def test_counts_of_one_are_said_in_the_singular(recipe_path):
    # `gpipe validate` of a planned one-device recipe said "1 stages x 1 replica, 1 micro-batches of 32".
    plan = make_plan(load_recipe(str(recipe_path), ["pipeline.partitions=1", "pipeline.microbatches=1"]),
                     available=1e15)
    assert ", 1 stage x 1 replica, 1 micro-batch of " in str(plan_table(plan).title)
    assert ", 2 stages x 1 replica, 4 micro-batches of " in str(plan_table(make_plan(
        load_recipe(str(recipe_path), []), available=1e15)).title)


def test_micro_batches_of_unequal_sizes_are_said_so(recipe_path):
    # `validate --set data.batch_size=30` said "4 micro-batches of 8"; they hold 8, 8, 7 and 7 examples.
    uneven = make_plan(load_recipe(str(recipe_path), ["data.batch_size=30", "pipeline.microbatches=4"]),
                       available=1e15)
    assert str(plan_table(uneven).title).endswith(", 4 micro-batches of 7 to 8")
    even = make_plan(load_recipe(str(recipe_path), ["data.batch_size=32", "pipeline.microbatches=4"]), available=1e15)
    assert str(plan_table(even).title).endswith(", 4 micro-batches of 8")
