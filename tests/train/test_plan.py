"""The plan says per stage whether it fits the machine; train refuses one that cannot, before any rank starts."""

import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.train import run as train_run
from gpipe_cli.train.plan import make_plan
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
    assert "stage 0 needs" in cramped.misfit() and "over" in cramped.misfit()
    # The ranks share the CPU's RAM: each gets an equal part.
    assert cramped.stages[0].capacity == pytest.approx(1e5 / 2, abs=1)
    assert cramped.to_json()["fits"] is False


def test_estimates_grow_with_the_batch(recipe_path):
    small = make_plan(load_recipe(str(recipe_path), []), available=1e15)
    large = make_plan(load_recipe(str(recipe_path), ["data.batch_size=64"]), available=1e15)
    assert all(b.memory.activations > a.memory.activations for a, b in zip(small.stages, large.stages))


def test_train_refuses_a_plan_that_cannot_fit_before_starting_ranks(recipe_path, monkeypatch):
    monkeypatch.setattr("gpipe_cli.memory_model.available_bytes", lambda device: 1000)
    monkeypatch.setattr(train_run, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(UserError, match="does not fit this machine") as caught:
        train_run.train(train_run.TrainOptions(str(recipe_path)))
    assert UserError.exit_code == 2 and "stage 1 needs" in str(caught.value)
