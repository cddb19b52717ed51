"""Flags that resize the measured model, shared by the commands that build one from `--model`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpipe_cli.recipe.aliases import SIZE_FLAGS  # aliases of the recipe's model keys


@dataclass
class SizeFlags:
    """Flags that resize the measured model (shared by bench and profile-memory)."""

    layers: int | None = None
    filters: int | None = None
    d_model: int | None = None
    ff: int | None = None
    heads: int | None = None
    vocab_size: int | None = None
    image_size: int | None = None
    seq_len: int | None = None
    num_classes: int | None = None

    def sizes(self) -> dict[str, int | None]:
        """The size flags, by name."""
        return {name: getattr(self, name) for name in SIZE_FLAGS}


def size_values(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The size flags among the alias flags typed (None: not typed), as SizeFlags' fields."""
    return {name: flags.get(name) for name in SIZE_FLAGS}
