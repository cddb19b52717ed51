"""The model zoo: AmoebaNet and Transformer as flat lists of independently buildable pipeline layers."""

from gpipe_cli.models.base import LayerSpec, ModelSpec
from gpipe_cli.models.describe import LayerCost, ModelSummary, count_parameters, describe, layer_params
from gpipe_cli.models.registry import (
    Preset,
    allowed_params,
    build_model,
    build_preset,
    presets,
    resolve_preset,
)

__all__ = ["LayerCost", "LayerSpec", "ModelSpec", "ModelSummary", "Preset", "allowed_params",
           "build_model", "build_preset", "count_parameters", "describe", "layer_params", "presets",
           "resolve_preset"]
