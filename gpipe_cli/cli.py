"""The `gpipe` command line: parse, load the recipe, call one function. No logic lives here."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import typer
import yaml
from rich.console import Console

from gpipe_cli.errors import UserError
from gpipe_cli.launch import LaunchOptions

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="GPipe pipeline-parallel training from YAML recipes.")
T = TypeVar("T")

RECIPE_HELP = "Recipe YAML file (default: the built-in quick-start recipe)."
SET_HELP = "Override a recipe key: KEY=VALUE (repeatable)."


def _guard(fn: Callable[[], T]) -> T:
    """Run a command; bad input becomes one line on stderr and its exit code, never a traceback."""
    try:
        return fn()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None


@app.command()
def train(
    recipe: str | None = typer.Argument(None, help=RECIPE_HELP),
    set_: list[str] | None = typer.Option(None, "--set", help=SET_HELP),
    output_dir: str | None = typer.Option(None, help="Write the run exactly here instead of outputs/<name>/<time>."),
    plain: bool | None = typer.Option(None, "--plain/--live", help="Plain log lines or the live view "
                                      "(default: live on a terminal)."),
    nnodes: str = typer.Option("1", help="Nodes in the job: N or MIN:MAX (torchrun)."),
    node_rank: int | None = typer.Option(None, help="This node's rank (static rendezvous)."),
    rdzv_endpoint: str | None = typer.Option(None, help="HOST:PORT of the rendezvous, the same on every node."),
    rdzv_backend: str | None = typer.Option(None, help="Rendezvous backend: static (with --node-rank) or c10d."),
    rdzv_id: str | None = typer.Option(None, help="Job id shared by all nodes (c10d rendezvous)."),
    threads: int | None = typer.Option(None, help="Intra-op threads per rank (default: cores / local ranks)."),
    resume: str | None = typer.Option(None, help="Continue from the newest whole checkpoint: 'latest' (the "
                                      "newest run of this recipe, or --output-dir), a run directory or a checkpoint."),
) -> None:
    """Train a model with GPipe on partitions x data_parallel processes."""
    from gpipe_cli.train.run import TrainOptions
    from gpipe_cli.train.run import train as run_training

    options = TrainOptions(recipe, set_ or [], output_dir, plain, resume, LaunchOptions(
        nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_backend=rdzv_backend,
        rdzv_id=rdzv_id, threads=threads))
    code = _guard(lambda: run_training(options))
    raise typer.Exit(code)


@app.command()
def validate(
    recipe: str | None = typer.Argument(None, help=RECIPE_HELP),
    set_: list[str] | None = typer.Option(None, "--set", help=SET_HELP),
    json_file: Path | None = typer.Option(None, "--json", help="Also write the recipe and plan as JSON here."),
) -> None:
    """Check a recipe and print the resolved recipe and the plan; trains nothing, reads no data."""
    from gpipe_cli.recipe.load import load_recipe, recipe_label
    from gpipe_cli.train.plan import checked_plan
    from gpipe_cli.train.plan_table import plan_table

    def run() -> None:
        loaded = load_recipe(recipe, set_ or [])
        plan = checked_plan(loaded, recipe_label(recipe))
        console = Console()
        console.print(yaml.safe_dump(loaded.model_dump(mode="json"), sort_keys=False), markup=False,
                      highlight=False)
        console.print(plan_table(plan))
        if json_file is not None:
            payload = {"recipe": loaded.model_dump(mode="json"), **plan.to_json()}
            json_file.write_text(json.dumps(payload, indent=2))

    _guard(run)


@app.command()
def export(
    run: str = typer.Argument(..., help="A run directory (its newest whole checkpoint) or one checkpoint folder."),
    output: str | None = typer.Option(None, help="The safetensors file to write (default: RUN/model.safetensors)."),
) -> None:
    """Write the consolidated model weights of a checkpoint as one safetensors file."""
    from gpipe_cli.train.export import export as export_model

    path = _guard(lambda: export_model(run, output))
    print(f"wrote {path}")


def main() -> None:
    """Console-script entry point."""
    sys.argv[1:] = _bare_resume(sys.argv[1:])
    app()


def _bare_resume(args: list[str]) -> list[str]:
    """Let `--resume` stand alone (meaning 'latest') as well as take a path."""
    out = list(args)
    for i, arg in enumerate(out):
        following = out[i + 1] if i + 1 < len(out) else None
        if arg == "--resume" and (following is None or following.startswith("-")
                                  or following.endswith((".yaml", ".yml"))):
            out.insert(i + 1, "latest")
            break
    return out


if __name__ == "__main__":
    main()
