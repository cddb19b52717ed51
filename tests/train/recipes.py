"""Small recipes the training tests write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TINY_AMOEBANET: dict[str, Any] = {
    "name": "tiny-amoeba", "seed": 3,
    "model": {"kind": "amoebanet", "layers": 3, "filters": 8, "image_size": 32, "num_classes": 4, "dropout": 0.1},
    "pipeline": {"partitions": 2, "microbatches": 4},
    "data": {"source": "synthetic", "batch_size": 16, "synthetic_size": 96},
    "train": {"steps": 4},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "eval": {"every": 2, "batches": 1},
}

TINY_TRANSLATION: dict[str, Any] = {
    "name": "tiny-translation", "seed": 1,
    "model": {"kind": "transformer", "layers": 2, "d_model": 32, "ff": 64, "heads": 4, "vocab_size": 512,
              "max_len": 40, "dropout": 0.1, "tie_embeddings": True},
    "pipeline": {"partitions": 2, "microbatches": 3},
    "data": {"source": "synthetic", "batch_size": 10, "synthetic_size": 200},
    "train": {"steps": 3},
    "optimizer": {"name": "adam", "lr": 0.001},
    "eval": {"batches": 1},
}


def write(folder: Path, recipe: dict[str, Any], name: str = "recipe.yaml") -> Path:
    """Write a recipe file and return its path."""
    path = folder / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
