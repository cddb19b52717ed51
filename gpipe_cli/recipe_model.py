"""The model a recipe describes, and the name the memory model prices its optimizer by.

Shared by the commands that read a recipe's model (train, validate, plan); the model zoo itself
knows nothing of recipes.
"""

from __future__ import annotations

from gpipe_cli.errors import UserError
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.recipe.schema import Recipe


def model_spec(recipe: Recipe) -> ModelSpec:
    """The ModelSpec a recipe's model section describes."""
    from gpipe_cli.models.registry import build_model

    params = recipe.model.model_dump(exclude={"kind", "preset"})
    try:
        return build_model(recipe.model.kind, **params)
    except ValueError as exc:
        raise UserError(f"model: {exc}") from None


def optimizer_name(recipe: Recipe) -> str:
    """The memory model's name for the recipe's optimizer (whose state it prices)."""
    opt = recipe.optimizer
    if opt.name == "sgd":
        return "sgd" if opt.momentum else "plain-sgd"
    if opt.name == "rmsprop":
        return "rmsprop" if opt.momentum else "rmsprop-no-momentum"
    return "rmsprop" if opt.name == "amoebanet-rmsprop" else opt.name
