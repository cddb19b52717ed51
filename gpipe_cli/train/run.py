"""`gpipe train` on the launching side: check the recipe and plan, then start (or join) the ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gpipe_cli.errors import UserError
from gpipe_cli.launch import LaunchOptions, launch, under_torchrun
from gpipe_cli.recipe.load import load_recipe, recipe_label
from gpipe_cli.train.loop import Job
from gpipe_cli.train.plan import checked_plan


@dataclass
class TrainOptions:
    """Everything `gpipe train` was asked to do."""

    recipe: str | None
    overrides: list[str] = field(default_factory=list)
    output_dir: str | None = None
    plain: bool | None = None
    launch: LaunchOptions = field(default_factory=LaunchOptions)


def train(options: TrainOptions) -> int:
    """Validate, then run the training job on K × D ranks; returns the exit code."""
    recipe = load_recipe(options.recipe, options.overrides)
    checked_plan(recipe, recipe_label(options.recipe))  # refuses impossible cuts before anything starts
    if options.output_dir and Path(options.output_dir).exists() and not Path(options.output_dir).is_dir():
        raise UserError(f"--output-dir: '{options.output_dir}' exists and is not a directory")
    job = Job(recipe=recipe.model_dump(mode="json"), output_dir=options.output_dir, plain=options.plain)
    world = recipe.pipeline.partitions * recipe.pipeline.data_parallel
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes but the recipe needs "
                            f"partitions x data_parallel = {world}")
        from gpipe_cli.train.worker import run_job

        run_job(job)
        return 0
    with tempfile.TemporaryDirectory(prefix="gpipe-") as folder:
        path = Path(folder) / "job.json"
        path.write_text(json.dumps(dataclasses.asdict(job)))
        return launch("gpipe_cli.train.worker", [str(path)], world, options.launch)
