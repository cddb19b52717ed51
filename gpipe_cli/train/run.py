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
from gpipe_cli.train.checkpoint import newest_whole
from gpipe_cli.train.loop import Job
from gpipe_cli.train.plan import checked_plan


@dataclass
class TrainOptions:
    """Everything `gpipe train` was asked to do."""

    recipe: str | None
    overrides: list[str] = field(default_factory=list)
    output_dir: str | None = None
    plain: bool | None = None
    resume: str | None = None  # "latest", a run directory or a checkpoint
    launch: LaunchOptions = field(default_factory=LaunchOptions)


def resume_location(options: TrainOptions, name: str, root: str = "outputs") -> str:
    """Where --resume continues from: an explicit path, --output-dir, or the newest run of this recipe."""
    if options.resume not in (None, "latest"):
        if not Path(options.resume).exists():
            raise UserError(f"--resume: no such run directory or checkpoint: '{options.resume}'")
        return str(options.resume)
    if options.output_dir:
        return options.output_dir
    runs = sorted((p for p in Path(root, name).glob("*") if p.is_dir()), reverse=True)
    for run in runs:
        if newest_whole(run)[0] is not None:
            return str(run)
    raise UserError(f"--resume: no run of '{name}' with a complete checkpoint under {Path(root, name)}/")


def train(options: TrainOptions) -> int:
    """Validate, then run the training job on K × D ranks; returns the exit code."""
    recipe = load_recipe(options.recipe, options.overrides)
    checked_plan(recipe, recipe_label(options.recipe), must_fit=not under_torchrun())  # refuses before any rank
    if options.output_dir and Path(options.output_dir).exists() and not Path(options.output_dir).is_dir():
        raise UserError(f"--output-dir: '{options.output_dir}' exists and is not a directory")
    job = Job(recipe=recipe.model_dump(mode="json"), output_dir=options.output_dir, plain=options.plain,
              resume=resume_location(options, recipe.name) if options.resume else None)
    world = recipe.pipeline.partitions * recipe.pipeline.data_parallel
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes but the recipe needs "
                            f"partitions x data_parallel = {world}")
        from gpipe_cli.train.worker import run_job

        return run_job(job)
    with tempfile.TemporaryDirectory(prefix="gpipe-") as folder:
        path = Path(folder) / "job.json"
        path.write_text(json.dumps(dataclasses.asdict(job)))
        return launch("gpipe_cli.train.worker", [str(path)], world, options.launch)
