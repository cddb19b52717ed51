"""Build any model of the zoo by kind and size parameters, or by the name of a preset from the paper."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from gpipe_cli.errors import near
from gpipe_cli.models import families
from gpipe_cli.models.amoebanet import build_amoebanet
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.presets import preset
from gpipe_cli.models.transformer import build_transformer

BUILDERS: dict[str, Callable[..., ModelSpec]] = {
    "amoebanet": build_amoebanet,
    "transformer": build_transformer,
}

def allowed_params(kind: str) -> list[str]:
    """The size parameters `kind` accepts."""
    # An unknown kind is refused by `families.of`, naming the kinds.
    return list(inspect.signature(BUILDERS[families.of(kind).kind]).parameters)


def resolve_preset(name: str, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """The kind and parameters of preset `name`, with `overrides` replacing individual keys."""
    kind, params = preset(name)
    params = {**params, **overrides}
    _check_params(kind, params)
    return kind, params


def build_model(kind: str, **size_params: Any) -> ModelSpec:
    """Build the ModelSpec of model family `kind` ("amoebanet" or "transformer") with these sizes."""
    _check_params(kind, size_params)
    return BUILDERS[kind](**size_params)


def _check_params(kind: str, params: dict[str, Any]) -> None:
    allowed = allowed_params(kind)
    for key in params:
        if key not in allowed:
            close = near(key, allowed)
            raise ValueError(f"unknown parameter {key!r} for model kind {kind!r}"
                             f"{f' (did you mean {close[0]}?)' if close else ''}; allowed: {', '.join(allowed)}")
