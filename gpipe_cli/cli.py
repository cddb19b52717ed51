"""The `gpipe` command line: parse, load the recipe, call one function. No logic lives here."""

from __future__ import annotations

if __name__ == "__main__":
    # `python -m gpipe_cli.cli`: the `gpipe` command, through the entry point, which holds a Ctrl-C from here on;
    # the imports below would otherwise load first, where a Ctrl-C is a traceback. It runs this module anew.
    from gpipe_cli.entry import main as _entry

    _entry()

import contextlib
import dataclasses
import errno
import functools
import inspect
import os
import shlex
import signal
import sys
import time
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any, TypeVar

import typer

from gpipe_cli import __version__, interrupts
from gpipe_cli.bench import CUTS as BENCH_CUTS
from gpipe_cli.bench import FLAGS as B
from gpipe_cli.bench import BenchOptions
from gpipe_cli.cli_help import polish
from gpipe_cli.console import output_console, print_table
from gpipe_cli.errors import UserError, near, one_line, path_line, shell_path, shown, shown_path
from gpipe_cli.files import (
    another_file,
    check_file_name,
    check_not_empty,
    check_not_input,
    check_not_stdout,
    check_output,
    check_output_kind,
    check_path,
    too_long_line,
    write_json,
)
from gpipe_cli.launch import launch_options
from gpipe_cli.limits import DIGITS, EXPORT_DTYPES, one_of, refuse
from gpipe_cli.pipeline.streams import stdout_refused, write_out
from gpipe_cli.plan import FLAGS as L
from gpipe_cli.plan import PlanOptions
from gpipe_cli.profile import CUTS as PROFILE_CUTS
from gpipe_cli.profile import FLAGS as P
from gpipe_cli.profile import ProfileOptions
from gpipe_cli.quick_exit import exit_now
from gpipe_cli.recipe.aliases import ALIASES, ONE_PIPELINE_BATCH, SET_HELP, SIZE_FLAGS, balance_help
from gpipe_cli.runs import RECIPE as RECIPE_FILE
from gpipe_cli.runs import is_run, kept_by_a_run
from gpipe_cli.train.output import to_null


class _Commands(typer.core.TyperGroup):
    """The commands: an int returned is the exit code; bad input is one line on stderr, never a traceback."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _reader_gone(), _stdout_lost():  # `gpipe --help | head -1`, `gpipe --help > /dev/full`
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        try:
            with _reader_gone(), _stdout_lost():
                code = super().invoke(ctx)
        except UserError as exc:
            _error(one_line(str(exc)))
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            # A path a command's own checks let through (each checks those it is given, before any work).
            _error(one_line(too_long_line(exc.filename)))
            raise typer.Exit(UserError.exit_code) from None
        raise typer.Exit(code if isinstance(code, int) else 0)


@contextlib.contextmanager
def _reader_gone() -> Iterator[None]:
    """A closed output pipe (`gpipe report | head -1`) ends the command quietly with a shell's code for it, 141."""
    # click and rich would exit 1, which reads as a failure of the command itself.
    try:
        yield
    except SystemExit as exc:
        if not isinstance(exc.__context__, BrokenPipeError):  # rich's way: SystemExit(1) raised from its write
            raise
        raise typer.Exit(128 + signal.SIGPIPE) from None
    except BrokenPipeError:
        to_null(sys.stdout)
        raise typer.Exit(128 + signal.SIGPIPE) from None


@contextlib.contextmanager
def _stdout_lost() -> Iterator[None]:
    """Standard output that cannot take what is written (`gpipe validate > /dev/full`) is one line and exit 1."""
    try:
        yield
    except OSError as exc:
        if not stdout_refused(exc):
            raise
        to_null(sys.stdout)
        _error(f"cannot write to standard output ({exc.strerror or exc}); what it should have shown is lost")
        raise typer.Exit(1) from None


app = typer.Typer(cls=_Commands, add_completion=False, pretty_exceptions_enable=False,
                  help="GPipe pipeline-parallel training from YAML recipes.")

# The recipe argument and --set of the commands that read a recipe as it is written.
RECIPE = typer.Argument(None, help="Recipe YAML file (default: the built-in quick-start recipe).")
SET = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP)
SIZE = "Model size (overrides)"
MODES = "Sweep, compare, simulate"
SIBLING_GRACE_S = 3.0
_launch = functools.partial(typer.Option, rich_help_panel="Nodes and ranks")  # train's options of where ranks run


def _error(message: str) -> None:
    """Print an error line; under torchrun each node's first rank at once, its siblings only if still running."""
    # Errors reach here only before a rank joins its job (a rank's own failure ends it inside the job), mostly from
    # the arguments and recipe every rank reads alike. A sibling that ended first would have torchrun stop the
    # node's first rank before it said the same error, which then said only that it was interrupted: the siblings
    # give it time to end first, and torchrun stops them as it does. A sibling still here found an error its
    # first rank did not. The exit code stays.
    if not interrupts.speaks_for_node():
        time.sleep(SIBLING_GRACE_S)
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except OSError:  # `2>&1 | head -0`, `2>/dev/full`: the line has no reader, and the exit code still says it
        to_null(sys.stderr)


def _interruptible(command: str, callback: Callable[..., Any], started: list[str]) -> Callable[..., Any]:
    """The command's function, noted in `started` as it begins, saying in one line that Ctrl-C stopped it."""
    @functools.wraps(callback)
    def run_command(*args: Any, **kwargs: Any) -> Any:
        started.append(command)
        try:
            return callback(*args, **kwargs)
        except (typer.Exit, UserError):
            raise
        except KeyboardInterrupt:  # typer would exit 130 without a word
            pass
        except BaseException as exc:  # torch's CheckpointException is not an Exception
            if isinstance(exc, SystemExit | GeneratorExit) or not interrupts.interrupted():
                raise
            # A library loading at the Ctrl-C turned it into an error of its own.
        # What is written is written whole or not at all.
        interrupts.say_stopped(f"gpipe {command}")
        raise typer.Exit(130) from None
    return run_command




class _Usage(typer.BadParameter):
    """A flag's value refused in a line that names the flag itself (click would prefix 'Invalid value for')."""

    def format_message(self) -> str:
        return self.message


def _whole(flag: str) -> Callable[[Any], int]:
    """The parser of an integer flag: a whole number written in digits, else one line naming `flag`."""
    def parse(value: Any) -> int:
        if isinstance(value, int):  # the default
            return value
        text = str(value).strip()
        # Not pydantic's lax int, which takes 2.0 for 2 and words its refusals its own way.
        if not DIGITS.fullmatch(text):
            raise _Usage(f"{flag}: must be a whole number written in digits, e.g. 4 (got {shown(str(value))})")
        try:
            return int(text)
        except ValueError:  # more digits than Python reads: beyond every bound a count has
            raise _Usage(f"{flag}: {len(text)} digits is beyond any value it takes") from None
    return parse


def _real(flag: str) -> Callable[[Any], float]:
    """The parser of a number flag: a number as Python writes one, else one line naming `flag` (its range: later)."""
    def parse(value: Any) -> float:
        if isinstance(value, int | float):  # the default
            return float(value)
        try:
            return float(str(value).strip())
        except ValueError:  # not pydantic's "Input should be a valid number", worded as no other flag is
            raise _Usage(f"{flag}: must be a number, e.g. 12 or 0.5 (got {shown(str(value))})") from None
    return parse


def _file(flag: str) -> Callable[[Any], Path]:
    """The parser of a file flag: a path, refused in one line when empty (Path would read it as '.')."""
    def parse(value: Any) -> Path:  # never a default: every file flag's is None
        check_not_empty(value, flag, give="name one, or leave the flag out")  # a long name: check_output's line
        check_file_name(str(value), flag)
        return Path(value)
    return parse


def _print_version(value: bool) -> None:
    if value:
        write_out(f"gpipe-cli {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """GPipe pipeline-parallel training from YAML recipes."""


@app.command()
def train(
    recipe: str | None = RECIPE,
    set_: list[str] | None = SET,
    output_dir: str | None = typer.Option(None, help="Write the run exactly here instead of outputs/<name>/<time>."),
    plain: bool | None = typer.Option(None, "--plain/--live", help="Plain log lines or the live view "
                                      "(default: live on a terminal)."),
    nnodes: str | None = _launch(None, help="Nodes (torchrun; default 1, or the nodes of the enclosing "
                                 "srun step); a range MIN:MAX only with MIN = MAX."),
    node_rank: int | None = _launch(None, parser=_whole("--node-rank"), help="This node's rank (static rendezvous)."),
    rdzv_endpoint: str | None = _launch(None, help="The rendezvous, the same on every node."),
    rdzv_backend: str | None = _launch(None, help="static (with --node-rank) or c10d."),
    rdzv_id: str | None = _launch(None, help="Job id shared by all nodes (c10d)."),
    threads: int | None = _launch(None, parser=_whole("--threads"),
                                  help="Intra-op threads per rank (default: cores / local ranks)."),
    resume: str | None = typer.Option(None, help="Continue from the newest whole checkpoint: bare --resume or "
                                      "'latest' (the newest run of this recipe that holds one, or --output-dir's), "
                                      "a run directory or a checkpoint."),
    dry_run: bool = _launch(False, "--dry-run", help="Print the launch on this node (rendezvous, nodes, ranks, from "
                            "Slurm under srun) and the torchrun command for it; start nothing."),
) -> int:
    """Train a model with GPipe on partitions x data_parallel processes."""
    from gpipe_cli.train.run import TrainOptions
    from gpipe_cli.train.run import train as run_training  # imports torch only once the recipe is valid

    launch = launch_options(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                            rdzv_backend=rdzv_backend, rdzv_id=rdzv_id, threads=threads)  # may read Slurm's
    return run_training(TrainOptions(recipe, set_ or [], output_dir, plain, resume, launch, dry_run))


@app.command()
def validate(
    recipe: str | None = RECIPE,
    set_: list[str] | None = SET,
    json_file: Path | None = typer.Option(None, "--json", parser=_file("--json"),
                                          help="Also write the recipe and plan as JSON here."),
) -> None:
    """Check a recipe and print the resolved recipe and the plan; trains nothing, reads no data."""
    from gpipe_cli.recipe.load import load_recipe, recipe_kind_note, recipe_label, recipe_read, recipe_yaml

    loaded = load_recipe(recipe, set_ or [])
    check_output(json_file, "--json", "recipe.json")
    if json_file is not None:
        instead = another_file(json_file, f"{json_file.stem}.plan.json")
        check_not_input(json_file, "--json", [recipe_read(recipe)], instead)
        check_output_kind(json_file, "--json")
    with interrupts.deferred():  # torch: only once the recipe is valid (and see export's)
        from gpipe_cli.train.plan import checked_plan, plan_table

    plan = checked_plan(loaded, recipe_label(recipe), sets=set_ or [])
    console = output_console()
    from gpipe_cli.recipe.schema import unread_settings

    for line in filter(None, [recipe_kind_note(recipe, set_ or []), *unread_settings(loaded)]):
        console.print(f"note: {line}", markup=False, highlight=False)
    console.print(recipe_yaml(loaded), markup=False, highlight=False)
    print_table(console, plan_table(plan), ("stage",), ("layers", "fits"))  # a narrow terminal cuts no figure
    if json_file is not None:
        payload = {"recipe": loaded.model_dump(mode="json"), **plan.to_json()}
        write_json(json_file, payload)
        # As export and report say it.
        console.print(f"wrote {path_line(json_file)}", markup=False, highlight=False, soft_wrap=True)


F = TypeVar("F", bound=Callable[..., Any])
LEAST_COLUMNS = 40  # the narrowest terminal the help and tables are laid out for
# A shown default is the command's own model's; a recipe given brings its own values.
OR_RECIPE = "; a RECIPE's own"


# An own flag the command does not declare takes the type and default of the field of `options` (a dataclass; a
# factory gives None) and reaches the command in `own`; alias values reach it in `flags` (None: not typed).
def _flags(options: type, own: Mapping[str, str], *aliases: str, modes: Collection[str] = (),
           shown: dict[str, str] | None = None, helps: Mapping[str, str] | None = None) -> Callable[[F], F]:
    """Give a command its own flags `own` (name -> help) and a `--set` alias flag per recipe key of `aliases`."""
    from gpipe_cli.recipe.aliases import description, flag, kind

    def option(name: str, annotation: Any, default: Any, **settings: Any) -> inspect.Parameter:
        panel = MODES if name in modes else SIZE if name in SIZE_FLAGS else None
        if int in (annotation, *typing.get_args(annotation)):
            settings["parser"] = _whole(flag(name))
        elif float in (annotation, *typing.get_args(annotation)):
            settings["parser"] = _real(flag(name))
        if Path in (annotation, *typing.get_args(annotation)):
            settings["parser"] = _file(flag(name))
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                 default=typer.Option(default, flag(name), rich_help_panel=panel, **settings))

    def add(command: F) -> F:
        declared = {p.name: p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                    for p in inspect.signature(command, eval_str=True).parameters.values()
                    if p.name not in ("own", "flags")}
        hints = typing.get_type_hints(options)
        defaults = {f.name: f.default for f in dataclasses.fields(options)}
        made = {name: option(name, hints[name] if defaults[name] is not MISSING else hints[name] | None,
                             None if defaults[name] is MISSING else defaults[name], help=own[name])
                for name in own if name not in declared}
        params = [*(p for name, p in declared.items() if name not in own), *(declared.get(n) or made[n] for n in own),
                  *(option(name, kind(name) | None, None, help=(helps or {}).get(name) or description(ALIASES[name]),
                           show_default=(shown or {}).get(name, False)) for name in aliases)]

        @functools.wraps(command)
        def with_flags(**kwargs: Any) -> Any:
            return command(**{name: kwargs[name] for name in declared},
                           own={name: kwargs[name] for name in made},
                           flags={name: kwargs[name] for name in aliases})

        with_flags.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        with_flags.__annotations__ = {p.name: p.annotation for p in params}
        return with_flags  # type: ignore[return-value]
    return add


@app.command()
@_flags(BenchOptions, B, *ALIASES, modes=("sweep", "compare", "simulate", "devices", "bandwidth", "latency_us",
                                          "oversubscribe"),
        shown={"partitions": f"2{OR_RECIPE}", "microbatches": f"8{OR_RECIPE}", "batch_size": f"4 x M{OR_RECIPE}",
               "balance": "by measured per-layer time"},
        helps={"balance": balance_help(BENCH_CUTS), "batch_size": ONE_PIPELINE_BATCH})
def bench(
    recipe: str | None = typer.Argument(None, help=B["recipe"]),
    model: str | None = typer.Option(None, help=B["model"], show_default=False),
    *, own: dict[str, Any], flags: dict[str, Any],
) -> int:
    """Measure training throughput at K stages and M micro-batches against K=1, with baselines and traces."""
    from gpipe_cli.bench import bench_options
    from gpipe_cli.bench import run as run_bench

    return run_bench(bench_options(recipe, flags, own.pop("set") or [], model=model, **own))


@app.command("profile-memory")
# Its own --partitions takes several K.
@_flags(ProfileOptions, P, *(name for name in ALIASES if name != "partitions"),
        shown={"microbatches": f"8{OR_RECIPE}",
               "batch_size": f"4 x M; with --budget the paper's: 128 AmoebaNet, 32 Transformer{OR_RECIPE}",
               "balance": "by estimated FLOPs: no layer is timed"},
        helps={"balance": balance_help(PROFILE_CUTS), "batch_size": ONE_PIPELINE_BATCH})
def profile_memory(
    recipe: str | None = typer.Argument(None, help=P["recipe"]),
    model: str | None = typer.Option(None, help=P["model"], show_default=False),
    partitions: str | None = typer.Option(None, metavar="K,K,...", help=P["partitions"], show_default=False),
    *, own: dict[str, Any], flags: dict[str, Any],
) -> int:
    """Memory per stage (parameters, gradients, optimizer, activations) for naive, pipeline-1 and pipeline-K."""
    from gpipe_cli.profile import profile_options
    from gpipe_cli.profile import run as run_profile

    return run_profile(profile_options(recipe, partitions, flags, own.pop("set") or [], model=model, **own))


@app.command()
@_flags(PlanOptions, L, "batch_size", *SIZE_FLAGS)
def plan(
    recipe: str | None = RECIPE,
    devices: int = typer.Option(..., parser=_whole("--devices"), help=L["devices"]),
    output: str | None = typer.Option(None, metavar="FILE", help=L["output"]),
    *, own: dict[str, Any], flags: dict[str, Any],
) -> int:
    """Predict the fastest K, D, M, schedule, remat mode and balance for N devices; write it as a recipe."""
    from gpipe_cli.estimate.model_flags import recipe_size_problem
    from gpipe_cli.plan import run as run_plan
    from gpipe_cli.plan.options import output_path
    from gpipe_cli.recipe.aliases import ALIASES, as_sets, by_flag, replaced, set_key
    from gpipe_cli.recipe.load import RecipeError

    # The alias flags are `--set` items, typed before the explicit ones, which win where both name a key (and
    # leave the flag out of the plan's command line).
    typed = own["set"] or []
    refuse([recipe_size_problem(recipe, flags, typed, built_in=True)])
    keys = {set_key(item) for item in typed}
    own["set"] = [*as_sets({name: value for name, value in flags.items() if ALIASES[name] not in keys}), *typed]
    for note in replaced(flags, typed):  # first, as bench and profile-memory say theirs
        output_console().print(f"[bold]note:[/] {note}", highlight=False)
    try:
        return run_plan(PlanOptions(recipe=recipe, devices=devices, output=output_path(output), **own))
    except RecipeError as exc:
        raise by_flag(exc, flags, sets=typed) from None


@app.command()
def export(
    run: str = typer.Argument(..., help="A run directory (its newest whole checkpoint) or one checkpoint folder."),
    output: str | None = typer.Option(None, help="The safetensors file to write (default: model.safetensors in "
                                                 "the run directory, also for a checkpoint folder; "
                                                 "model-FOLDER.safetensors for a course a resume set aside in "
                                                 "checkpoints/FOLDER)."),
    dtype: str | None = typer.Option(None, metavar="|".join(EXPORT_DTYPES),
                                     help="Store the floating-point weights in this type (default: as trained)."),
) -> None:
    """Write a checkpoint's model as one safetensors file holding its recipe, tie map and tokenizer."""
    from gpipe_cli.train.existing import check_export_arguments

    refuse([None if dtype is None else one_of("--dtype", dtype, EXPORT_DTYPES)])
    check_export_arguments(run, output)  # in a fraction of a second: torch's import takes seconds
    with interrupts.deferred():  # torch's import runs Python from C++, where a Ctrl-C is lost or aborts the process
        from gpipe_cli.train.export import export as export_model

    write_out(f"wrote {path_line(export_model(run, output, dtype))}\n")


@app.command()
def predict(
    model: str = typer.Argument(..., metavar="MODEL", help="A file written by gpipe export, or the run directory "
                                "it wrote model.safetensors into."),
    inputs: list[str] | None = typer.Argument(None, metavar="INPUT", help="Sentences to translate, a "
                                              "prompt to continue, or image files to classify (default: "
                                              "one per line of stdin)."),
    max_tokens: int | None = typer.Option(None, parser=_whole("--max-tokens"),
                                          help="Tokens to generate after a language model's prompt "
                                          "[default: 50]."),
    top: int | None = typer.Option(None, parser=_whole("--top"),
                                   help="Classes to print per image, most likely first [default: 1]."),
) -> int:
    """Use an exported model without the pipeline: translate, continue a prompt or classify images."""
    from gpipe_cli.predict import predict as run_predict

    return run_predict(model, inputs or None, max_tokens, top)


@app.command("prepare-data")
def prepare_data(
    recipe: str = typer.Argument(..., metavar="RECIPE", help="A recipe with data.source hub: its data.name and "
                                 "data.config are saved."),
    output: str = typer.Option(..., metavar="DIR", help="The new folder to write the parquet files into."),
    set_: list[str] | None = SET,
) -> None:
    """Save a recipe's Hugging Face dataset once as local parquet files, for machines without network."""
    from gpipe_cli.data.prepare import prepare_data as save
    from gpipe_cli.recipe.load import load_recipe, recipe_read
    if not recipe.strip():  # load_recipe's line advises leaving it out, which this command cannot
        raise UserError(f"the recipe path is {'only spaces' if recipe else 'empty'}; give the YAML file of a recipe "
                        "with data.source hub")
    check_path(output, "--output", "folder", "name a new folder, e.g. data/NAME")  # Path would read '' as '.'
    check_not_stdout(output, "--output", "new folder", "data/NAME")
    check_not_input(Path(output), "--output", [recipe_read(recipe)], "name a new folder")
    if (kept := kept_by_a_run(Path(output))) is not None:  # a run's pruning would delete the data with it
        raise UserError(f"--output {shown_path(output)} {kept[1]}; name a new folder outside it")
    files = save(load_recipe(recipe, set_ or []).data, Path(output))
    write_out(f"wrote {path_line(output)} ({len(files)} parquet file{'s' if len(files) > 1 else ''}); train with "
              f"--set data.source=parquet --set data.path={shell_path(output)}\n")


@app.command("report")
def report_runs(
    runs: list[str] = typer.Argument(..., help="Run directories (each with metrics.jsonl)."),
    output: str | None = typer.Option(None, metavar="FILE", help="The page to write: .png, .pdf or .svg (default: "
                                      "RUN_DIR/report.png for one run, report.png here for several)."),
) -> int:
    """Compare runs: a table of their figures here and a one-page PNG of curves (several runs overlaid)."""
    from gpipe_cli.report import report

    for run in runs:  # Path would read '' as '.'
        check_path(run, "RUN_DIR", "run", "give the folder `gpipe train` wrote")
    check_not_empty(output, "--output", give="name one, e.g. report.png, or leave the flag out")
    check_file_name(output, "--output")
    return report([Path(r) for r in runs], None if output is None else Path(output))


def run(args: list[str]) -> int:
    """Run the command line on `args`; every usage error is one line on stderr. Returns the exit code."""
    try:
        os.getcwd()
    except FileNotFoundError:  # removed under the shell: relative paths and the ranks' start failed in tracebacks
        _error("the current directory no longer exists; cd to one that does and run the command again")
        return 2
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) < LEAST_COLUMNS:  # rich prints nothing at 0, a word a line at 5
        os.environ["COLUMNS"] = str(LEAST_COLUMNS)
    command = polish(typer.main.get_command(app))
    started: list[str] = []
    for name, sub in getattr(command, "commands", {}).items():
        sub.callback = _interruptible(name, sub.callback, started)
    if not args:
        args = ["--help"]
    if args[0] == "help":  # `gpipe help train`, as git and pip take it
        if len(args) > 2:
            _error(f"help takes one command; got {len(args) - 1}: {' '.join(args[1:])} (see 'gpipe --help')")
            return 2
        args = [*args[1:2], "--help"]
    given = _home_expanded(_bare_resume(_short_help(args)))
    if said := _option_misuse(given, getattr(command, "commands", {})):
        _error(f"{said} (see 'gpipe {given[0]} --help')")
        return 2
    try:
        result = command.main(args=given, prog_name="gpipe", standalone_mode=False)
    except typer.Exit as exc:
        result = exc.exit_code
    except typer.TyperException as exc:  # click's usage errors: unknown option, bad type, missing argument
        named = f"gpipe {args[0]}" if args and args[0] in getattr(command, "commands", {}) else "gpipe"
        # Some of click's errors (an option missing its value) carry no context: the command typed names it.
        where = getattr(getattr(exc, "ctx", None), "command_path", None) or named
        said = _unknown_option(exc, where, args, getattr(command, "commands", {})) or _extra_argument(exc, args)
        _error(f"{said or one_line(exc.format_message())} (see '{where} --help')")
        return int(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    if result == 130 and not started:  # typer turns a Ctrl-C while it parses the arguments into a silent 130
        interrupts.say_stopped("gpipe")
    return result if isinstance(result, int) else 0


def main() -> None:
    """Run this process's command line and exit with its code (`gpipe_cli.entry` calls it once Ctrl-C is held)."""
    interrupts.stop_on_signals()
    exit_now(interrupts.exit_code(run(sys.argv[1:])))


# Words a user may try for a flag whose name is no near spelling of them: profile-memory's --budget is plan's
# --device-memory (the memory of each device either way).
_SAME_MEANING = {"gpipe plan": dict.fromkeys(("budget", "memory", "mem", "gpu-memory"), "--device-memory")}


def _unknown_option(exc: Exception, where: str, args: list[str], commands: Mapping[str, Any]) -> str:
    """An unknown option's line: the --set of the recipe key it names, the commands that have it, or a near option."""
    from gpipe_cli.recipe.aliases import ALIASES
    from gpipe_cli.recipe.load import key_of_flag

    # By name: typer may carry its own copy of click, whose classes are not click's.
    if type(exc).__name__ != "NoSuchOption":
        return ""
    typed, _, value = str(getattr(exc, "option_name", "")).partition("=")
    if len(typed) == 2 and typed[0] == "-" != typed[1]:  # `-resume`, which click reads as the short options -r...
        typed = next((a.partition("=")[0] for a in args if a.startswith(typed) and a[:2] != "--"), typed)
    said = f"No such option: {typed}"
    sets = where in ("gpipe train", "gpipe validate")  # the commands that read a recipe as it is written
    key = (key_of_flag(typed) or ALIASES.get(typed.lstrip("-").replace("-", "_"))) if sets else None
    if key is not None:
        return f"{said}; {where} takes it as --set {_set_item(key, typed, value, args)}"
    # click's own suggestions were any option of a few letters in common: `--step` was offered --help and --set.
    others = [f"gpipe {name}" for name, sub in commands.items()
              if f"gpipe {name}" != where and any(typed in (*p.opts, *p.secondary_opts) for p in sub.params)]
    named = " and ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
    has = f"{named} {'have' if len(others) > 1 else 'has'} it"
    params = getattr(getattr(getattr(exc, "ctx", None), "command", None), "params", [])
    own = {name.lstrip("-"): name for p in params for name in (*p.opts, *p.secondary_opts) if name.startswith("--")}
    close = [own[name] for name in near(typed.lstrip("-"), own, 3, prefix=True)]
    meant = _SAME_MEANING.get(where, {}).get(typed.lstrip("-"))
    close = [meant, *(c for c in close if c != meant)] if meant in own.values() else close
    if others:  # `plan --device`: plan's own --devices first, profile-memory's --device (cpu or cuda) beside it
        return f"{said} ({has}); did you mean {' or '.join(close)}?" if close else f"{said}; {has}"
    if sets and (key := key_of_flag(typed, close=True)) is not None:
        return f"{said}; did you mean --set {_set_item(key, typed, value, args)}?"
    return f"{said}; did you mean {' or '.join(close)}?" if close else said


def _option_misuse(args: list[str], commands: Mapping[str, Any]) -> str | None:
    """An option whose value would be the next option, which click takes as its value without a word."""
    # `train --output-dir --dry-run` trained 200 steps into a folder named --dry-run. An option given twice takes
    # its last value, as a shell alias that gives it first expects.
    command = commands.get(args[0]) if args else None
    if command is None:
        return None
    options = {opt: p for p in command.params if p.param_type_name == "option" for opt in (*p.opts, *p.secondary_opts)}
    for typed, value in zip(args[1:], args[2:]):
        if typed == "--":
            break
        param = options.get(typed)
        if param is not None and not param.is_flag and value.startswith("--") and len(value) > 2:
            return (f"{typed} takes a value, and the next word is the option {value}: give {typed} its value first "
                    f"(a name that begins with -- is written ./{value})")
    return None


def _extra_argument(exc: Exception, args: list[str]) -> str:
    """click's line for extra arguments, with the --set of each typed as KEY=VALUE where the command takes --set."""
    from gpipe_cli.recipe.yamlio import as_set

    said = one_line(exc.format_message()) if isinstance(exc, typer.TyperException) else ""
    params = getattr(getattr(getattr(exc, "ctx", None), "command", None), "params", [])
    if not said.startswith("Got unexpected extra argument") or not any("--set" in p.opts for p in params):
        return ""
    # click lists them joined by spaces; an item typed after --set is that option's value, never an extra one.
    listed = f" {said.partition(' (')[2].removesuffix(')')} "  # `argument(s) (A B)` in some versions of click
    items = [item for arg, before in zip(args, ["", *args]) if before != "--set" and f" {arg} " in listed
             and (item := as_set(arg)) is not None]
    return f"{said}; to override a recipe key give {' '.join(dict.fromkeys(items))}" if items else ""


def _set_item(key: str, typed: str, value: str, args: list[str]) -> str:
    """`KEY=VALUE` with the value typed after the flag, or joined to it by =, shell-quoted (`KEY=VALUE` if none)."""
    for arg, following in zip(args, [*args[1:], None]):
        if arg.partition("=")[0] == typed:
            value = arg.partition("=")[2] if "=" in arg else following or ""
            break
    return shlex.quote(f"{key}={value}") if value else f"{key}=VALUE"


def _a_runs_recipe(path: str) -> bool:
    """Whether `path` is the recipe.yaml a run directory keeps beside its records and checkpoints."""
    return os.path.basename(path) == RECIPE_FILE and is_run(Path(os.path.dirname(path) or "."))


def _short_help(args: list[str]) -> list[str]:
    """`-h` as `--help`, as most commands take it (before `--`, after which a word is an input)."""
    # Not declared as a help option name: it would take a column of its own in every listing.
    end = args.index("--") if "--" in args else len(args)
    return ["--help" if arg == "-h" else arg for arg in args[:end]] + args[end:]


def _home_expanded(args: list[str]) -> list[str]:
    """`--flag=~/x` as `--flag ~/x` reaches a command: the shell expands no ~ after the = (a folder named ~ here)."""
    return [f"{flag}={os.path.expanduser(value)}" if flag.startswith("--") and eq and value.startswith("~") else arg
            for arg in args for flag, eq, value in [arg.partition("=")]]


def _bare_resume(args: list[str]) -> list[str]:
    """Let `--resume` stand alone (meaning 'latest') as well as take a path."""
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else None
        if arg == "--resume" and following is not None and _a_runs_recipe(following):
            # RUN/recipe.yaml means that run, not the newest run of that recipe's name.
            return [*args[:i + 1], os.path.dirname(following) or ".", *args[i + 2:]]
        if arg == "--resume" and (following is None or following.startswith("-")
                                  or following.endswith((".yaml", ".yml"))):
            return [*args[:i + 1], "latest", *args[i + 1:]]
    return args

