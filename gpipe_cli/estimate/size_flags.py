"""Flags that resize the measured model, shared by the commands that build one from `--model`."""

from __future__ import annotations

from dataclasses import dataclass

SIZE_FLAGS = ("layers", "filters", "d_model", "ff", "heads", "vocab_size", "image_size", "seq_len", "num_classes")


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
