"""Small models that every bench and profile test can afford on a CPU."""

from __future__ import annotations

from typing import Any

# A decoder-only Transformer: embedding, 4 layers, softmax (6 pipeline layers).
TRANSFORMER: dict[str, Any] = dict(model="transformer", layers=4, d_model=32, ff=64, heads=2, vocab_size=64,
                                   seq_len=8, set=["arch=decoder-only"])
# AmoebaNet-D (3, 8) on 32-pixel images: stem, 4 reduction cells and 3 normal cells of six layers each, classifier
# (44 layers).
AMOEBANET: dict[str, Any] = dict(model="amoebanet", layers=3, filters=8, image_size=32, num_classes=4)


def sizes(kw: dict[str, Any]) -> dict[str, Any]:
    """Only the size flags of a tiny model's keyword arguments."""
    return {k: v for k, v in kw.items() if k not in ("model", "set")}
