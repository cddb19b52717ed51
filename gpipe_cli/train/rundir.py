"""The run directory: `outputs/<name>/<timestamp>/` (or exactly `--output-dir`), written atomically."""

from __future__ import annotations

import datetime
from pathlib import Path

from gpipe_cli.files import atomic_write_bytes
from gpipe_cli.recipe.load import recipe_yaml
from gpipe_cli.recipe.schema import Recipe

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
PREFIX = "step-"  # of a checkpoint folder: checkpoints/step-00000100


def choose_run_dir(recipe: Recipe, output_dir: str | None, root: str = "outputs") -> Path:
    """The directory this run will write to (not created yet)."""
    if output_dir:
        return Path(output_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(root) / recipe.name / stamp
    suffix = 1
    while path.exists():  # two runs started in the same second
        path = Path(root) / recipe.name / f"{stamp}-{suffix}"
        suffix += 1
    return path


def create_run_dir(path: Path) -> None:
    """Create the run directory and its checkpoints folder."""
    (path / CHECKPOINTS).mkdir(parents=True, exist_ok=True)


def save_recipe(recipe: Recipe, run_dir: Path) -> None:
    """Store the resolved recipe (every default filled in) with the run."""
    atomic_write_bytes(run_dir / RECIPE, recipe_yaml(recipe).encode())
