"""The model zoo: AmoebaNet and Transformer as flat lists of independently buildable pipeline layers.

The public names are imported on first use, so that the families' facts (`families`) load without torch;
`describe` is its module (the function is `describe.describe`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpipe_cli.models.base import LayerSpec, ModelSpec
    from gpipe_cli.models.describe import LayerCost, ModelSummary, count_parameters, layer_params
    from gpipe_cli.models.registry import Preset, allowed_params, build_model, build_preset, presets, resolve_preset

_WHERE = {
    **dict.fromkeys(("LayerSpec", "ModelSpec"), "gpipe_cli.models.base"),
    **dict.fromkeys(("LayerCost", "ModelSummary", "count_parameters", "layer_params"),
                    "gpipe_cli.models.describe"),
    **dict.fromkeys(("Preset", "allowed_params", "build_model", "build_preset", "presets", "resolve_preset"),
                    "gpipe_cli.models.registry"),
}

__all__ = ["LayerCost", "LayerSpec", "ModelSpec", "ModelSummary", "Preset", "allowed_params",
           "build_model", "build_preset", "count_parameters", "layer_params", "presets",
           "resolve_preset"]


def __getattr__(name: str) -> Any:
    """A public name of the package, imported from its module on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gpipe_cli.models' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
