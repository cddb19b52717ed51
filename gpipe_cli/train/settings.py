"""The settings a `gpipe train` runs with, and for a resume the one line that says which.

A resume without a recipe continues the run as it was started: the run's own resolved recipe.yaml is
the configuration, with any `--set` of the resume on top. The built-in quick-start recipe, which a new
run without a recipe trains, says nothing about a run started with other settings (`--set
train.steps=2000` would silently become its 200 steps). A recipe given explicitly is used as given (a
requeued job's script names its recipe every time), and every difference from the run's recipe.yaml is
listed. Either way the line comes before any rank starts. Nothing here imports torch at module level:
most mistakes are reported before it loads.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from gpipe_cli.errors import UserError, cut, shown
from gpipe_cli.recipe.load import apply_override, default_recipe_text, load_recipe, parse_yaml
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.train.existing import PATH_CHARS, RECIPE, Change, holds_run, run_dir_of

LATEST = "latest"  # a bare --resume


def check_resume_path(resume: str | None) -> None:
    """Refuse a --resume location that does not exist (a bare --resume is looked up later)."""
    if resume not in (None, LATEST) and not os.path.exists(resume):
        raise UserError(f"--resume: no such run directory or checkpoint: {shown(resume)}")


def train_recipe(recipe: str | None, overrides: Sequence[str], resume: str | None, output_dir: str | None,
                 root: str) -> tuple[Recipe, str | None]:
    """The recipe this command trains, and the file it was read from (None: the built-in one).

    Without a recipe a resume reads the run's own recipe.yaml (and applies `overrides` to it); a
    directory that holds no run yet, as a requeued job's first launch finds it, takes the built-in one.
    """
    if resume is None or recipe is not None:
        return load_recipe(recipe, overrides), recipe
    run = _run_to_continue(resume, output_dir, overrides, root)
    if run is None:
        return load_recipe(None, overrides), None
    path = run / RECIPE
    if not path.is_file():
        where = cut(str(run), PATH_CHARS)
        raise UserError(f"--resume {where}: the run has no {RECIPE} to continue with; give the recipe it was started "
                        f"with: gpipe train RECIPE --resume {where}")
    return load_recipe(str(path), overrides), str(path)


def resume_location(resume: str, output_dir: str | None, name: str, root: str) -> str:
    """Where --resume continues from: an explicit path, --output-dir, or the newest run named `name`."""
    if resume != LATEST:  # checked to exist before the recipe was read
        return resume
    if output_dir:
        return output_dir
    from gpipe_cli.train.checkpoint import newest_whole  # torch: only once the first checks are done

    runs = sorted((p for p in Path(root, name).glob("*") if p.is_dir()), reverse=True)
    for run in runs:
        if newest_whole(run)[0] is not None:
            return str(run)
    raise UserError(f"--resume: no run of '{name}' with a complete checkpoint under {Path(root, name)}/")


def _run_to_continue(resume: str, output_dir: str | None, overrides: Sequence[str], root: str) -> Path | None:
    """The run directory a resume without a recipe continues (None: --output-dir holds no run yet)."""
    if resume == LATEST and output_dir:
        return Path(output_dir) if holds_run(Path(output_dir)) else None
    # A bare --resume looks for the newest run of the built-in recipe's name (or a `--set name=` given).
    name = "" if resume != LATEST else _name(overrides)
    return run_dir_of(resume_location(resume, output_dir, name, root))


def _name(overrides: Sequence[str]) -> str:
    """The run name of the built-in recipe with `overrides` applied (only the name: the run's recipe.yaml,
    not the built-in recipe, is what the rest of them apply to)."""
    raw = parse_yaml(default_recipe_text(), "quickstart.yaml (built in)")
    for item in overrides:
        apply_override(raw, item)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"--set name: must be a run name (got {shown(name)})")
    return name


def resume_line(run_dir: Path, step: int | None, changes: list[Change] | None, recipe: str | None,
                continued: bool, overrides: Sequence[str]) -> str:
    """The one line that says which run a resume continues, from which step, and with which settings.

    `continued`: the run's own recipe.yaml is the configuration (no recipe was given), so every change
    is one of the `overrides`; otherwise `recipe` (None: the built-in one) replaces the run's, and
    `changes` lists every difference from it (None: the run has no readable recipe.yaml).
    """
    where = f"resuming {run_dir}" + (f" at step {step}" if step is not None else "")
    listed = ", ".join(map(str, changes or []))
    if continued:
        if listed:
            return f"{where} with {listed} (--set)"
        return f"{where} with the run's own settings ({run_dir / RECIPE})"
    given = recipe if recipe is not None else "the built-in quick-start recipe"
    if overrides:
        given += " and --set"
    if changes is None:
        return f"{where} with {given} (the run has no readable {RECIPE} to compare it with)"
    if not listed:
        return f"{where} with {given}, the same settings as the run's"
    return f"{where} with {given}, which {'differ' if overrides else 'differs'} from the run's {RECIPE}: {listed}"


def continue_command(run_dir: Path) -> str:
    """The command that continues a stopped run as it was started, ready to copy."""
    return f"gpipe train --resume {shlex.quote(str(run_dir))}"
