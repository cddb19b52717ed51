"""The run directory: `outputs/<name>/<timestamp>/` (or exactly `--output-dir`), written atomically."""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import yaml

from gpipe_cli.recipe.schema import Recipe


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
    (path / "checkpoints").mkdir(parents=True, exist_ok=True)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file so that it either exists whole or not at all (write to a temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all."""

    def write(f: IO[bytes]) -> None:
        f.write(data)

    atomic_write(path, write)


def save_recipe(recipe: Recipe, run_dir: Path) -> None:
    """Store the resolved recipe (every default filled in) with the run."""
    text = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
    atomic_write_bytes(run_dir / "recipe.yaml", text.encode())
