"""`gpipe train` on the launching side: check the recipe and plan, then start (or join) the ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gpipe_cli import interrupts
from gpipe_cli.console import redraws, say
from gpipe_cli.data.offline import check_hub_data
from gpipe_cli.errors import UserError, shown_path
from gpipe_cli.files import RUN_FILES_BYTES, check_not_stdout, check_path, check_room_below, check_writable
from gpipe_cli.launch import LaunchOptions, NothingStarted, check_device, check_launch, launch, under_torchrun, warming
from gpipe_cli.launch.preflight import dry_run_lines, endpoint_source, node_flags, rendezvous, resolve
from gpipe_cli.models import families
from gpipe_cli.progress import note
from gpipe_cli.recipe.load import recipe_kind_note, recipe_label, typed_values
from gpipe_cli.recipe.schema import Recipe, unread_settings
from gpipe_cli.runs import METRICS, candidates, holds_run, run_dir_of
from gpipe_cli.train import output
from gpipe_cli.train.claim import held, missing
from gpipe_cli.train.existing import (
    Change,
    check_a_run_to_resume,
    check_checkpoint_keys,
    check_new_run_dir,
    check_not_in_a_run,
    check_recipe_kept,
    check_resumable,
    check_resume_output,
    check_resume_path,
    check_tokenizer_kept,
    choose_run_dir,
    complete_line,
    continue_command,
    earlier_checkpoint,
    held_changes,
    recipe_changes,
    remove_set_up,
    resume_end,
    resume_line,
    resume_location,
    settings_of,
    settings_unkept,
    starts_anew,
    train_recipe,
)
from gpipe_cli.train.worker import STARTED, Job
from gpipe_cli.units import counted

OUTPUTS = "outputs"


def first_line(recipe: Recipe) -> str:
    """What is starting: recipe, model, K, M, D and the number of ranks."""
    p, t = recipe.pipeline, recipe.train
    length = " and ".join(counted(n, unit) for n, unit in ((t.steps, "step"), (t.epochs, "epoch")) if n)
    batch = recipe.data.batch_size if recipe.data.tokens_per_batch is None else \
        f"{recipe.data.tokens_per_batch:,} tokens"  # the budget decides how many examples
    return (f"gpipe train {recipe.name}: {_model_name(recipe)}, K={counted(p.partitions, 'stage')} x "
            f"D={p.data_parallel} = {counted(p.partitions * p.data_parallel, 'rank')}, "
            f"M={counted(p.microbatches, 'micro-batch', 'micro-batches')}, batch {batch}, {length}, {t.precision}")


def _model_name(recipe: Recipe) -> str:
    """The preset's name where the recipe keeps its shape, else the model's own (`model.layers` on a preset)."""
    m, family = recipe.model, families.of(recipe.model.kind)
    title = family.title(m.model_dump(), False)
    if not m.preset:
        return title
    from gpipe_cli.models.presets import preset

    given = m.model_dump()
    # The sizes the data sets (vocabulary, image size) are not part of a preset's name.
    return m.preset if all(given.get(k, v) == v for k, v in preset(m.preset)[1].items()
                           if k not in family.data_sizes) else title


def checking(recipe: Recipe, terminal: bool) -> contextlib.AbstractContextManager[Any]:
    """While the block runs, the first line as a transient status on a terminal, so that an error stands alone."""
    if not terminal:
        return contextlib.nullcontext()
    from rich.console import Console

    return Console().status(f"{first_line(recipe)}: checking the plan", spinner="dots")


def oversubscription(ranks: int, threads: int, cores: int, gpus: int) -> str | None:
    """A warning when this node's ranks outnumber its GPUs (gpus > 0) or their threads its cores."""
    if gpus > 0:
        if ranks <= gpus:
            return None
        return (f"warning: {ranks} ranks share {counted(gpus, 'GPU')} on this node (oversubscribed): "
                f"they take turns on the devices and exchange tensors through host memory, so steps are slower "
                f"and the measured bubble larger than with a GPU per rank")
    if ranks * threads <= cores:
        return None
    return (f"warning: {ranks} ranks x {counted(threads, 'thread')} on {cores} CPU "
            f"core{'s' if cores != 1 else ''} (oversubscribed): the ranks take turns on the cores, so steps are "
            f"slower and the measured bubble larger than with a core per rank")


def local_ranks(world: int, nnodes: str) -> int:
    """Ranks this node runs: the job's share per node, or torchrun's count when already under it."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        nodes = int(nnodes.partition(":")[2] or nnodes.partition(":")[0])
    except ValueError:  # the launcher reports a bad --nnodes
        nodes = 1
    return max(world // max(nodes, 1), 1)


def announce(recipe: Recipe, nnodes: str, threads: int | None, stream: TextIO, said: bool = False) -> None:
    """Print the first line (unless `said`), then (after looking for GPUs) any oversubscription warning."""
    if not said:
        say(first_line(recipe), stream)
    warning = node_oversubscribed(recipe, nnodes, threads)
    if warning:
        say(warning, stream)


def node_oversubscribed(recipe: Recipe, nnodes: str, threads: int | None) -> str | None:
    """The warning when this node's ranks would share its cores or GPUs, else None."""
    ranks = local_ranks(recipe.pipeline.partitions * recipe.pipeline.data_parallel, nnodes)
    import torch  # only now: the first line is already on the screen

    from gpipe_cli.contention import usable_cores

    gpus = torch.cuda.device_count() if recipe.train.device != "cpu" and torch.cuda.is_available() else 0
    cores = usable_cores()
    return oversubscription(ranks, threads or max(cores // ranks, 1), cores, gpus)


@dataclass
class TrainOptions:
    """Everything `gpipe train` was asked to do."""

    recipe: str | None
    overrides: list[str] = field(default_factory=list)
    output_dir: str | None = None
    plain: bool | None = None
    resume: str | None = None  # "latest", a run directory or a checkpoint
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    dry_run: bool = False  # print the launch (rendezvous, ranks, the torchrun command) and start nothing


def train_args(options: TrainOptions) -> list[str]:
    """The arguments of `gpipe train` that every rank reads (the recipe and what changes the run), as typed."""
    args = [options.recipe] if options.recipe is not None else []
    for item in options.overrides:
        args += ["--set", item]
    if options.output_dir:
        args += ["--output-dir", options.output_dir]
    if options.resume:
        args += ["--resume", options.resume]
    if options.plain is not None:
        args.append("--plain" if options.plain else "--live")
    return args


def train(options: TrainOptions) -> int:
    """Validate, then run the training job on K × D ranks; returns the exit code."""
    started = time.time()
    output.guard_output()  # a reader that goes loses the launcher's lines; rank 0 stops the run when it finds it gone
    # An empty one read as no flag at all, and the run went to outputs/<name>/<time>.
    check_path(options.output_dir, "--output-dir", "directory",
               f"give one, or leave the flag out for {OUTPUTS}/<name>/<time>")
    check_not_stdout(options.output_dir, "--output-dir", "directory", "runs/NAME",
                     f", or leave the flag out for {OUTPUTS}/<name>/<time>")
    check_resume_path(options.resume)
    check_not_in_a_run(options.output_dir)
    check_resume_output(options.resume, options.output_dir)
    check_recipe_kept(options.recipe, options.output_dir, options.resume)
    # Without a recipe, a resume trains with the run's own recipe.yaml (`recipe_file` names it).
    recipe, recipe_file = train_recipe(options.recipe, options.overrides, options.resume, options.output_dir, OUTPUTS)
    world = recipe.pipeline.partitions * recipe.pipeline.data_parallel
    if under_torchrun() and (ranks := int(os.environ["WORLD_SIZE"])) != world:  # every rank at once, before torch
        raise UserError(f"torchrun started {ranks} process{'es' if ranks != 1 else ''} but the recipe needs "
                        f"partitions x data_parallel = {world}")
    local = check_launch(options.launch, world)
    if not under_torchrun():  # before seconds of planning, as the launch would find it
        from gpipe_cli.launch.launcher import open_files_as_allowed

        open_files_as_allowed()
    if options.launch.rdzv_endpoint and not options.dry_run and not under_torchrun():  # before seconds of planning
        resolve(options.launch.rdzv_endpoint, endpoint_source(options.launch))
    if options.output_dir and os.path.exists(options.output_dir) and not os.path.isdir(options.output_dir):
        raise UserError(f"--output-dir: {shown_path(options.output_dir)} exists and is not a directory")
    if starts_anew(options.resume, options.output_dir):  # a new run's folder: refused before seconds of measuring
        if options.output_dir:
            # Another node's launcher (or rank) of this job: the directory is node 0's to claim, perhaps already.
            check_new_run_dir(Path(options.output_dir), ours=claimed_elsewhere(options.launch, world))
        new_run = (Path(options.output_dir), "--output-dir", "") if options.output_dir else \
            (Path(OUTPUTS) / recipe.name, "the output directory", "; give --output-dir DIR to write the run elsewhere")
        check_writable(*new_run)
        # outputs/<name> gets a folder of the start's time (20261207-101500-1) below it.
        check_room_below(new_run[0], new_run[1], RUN_FILES_BYTES + (0 if options.output_dir else 20))
    # Not after seconds of planning. Under torchrun, rank 0 claims the run as the other ranks check it: theirs is not
    # another gpipe train's.
    check_a_run_to_resume(options.resume, options.output_dir, recipe.name, OUTPUTS,
                          ours=claimed_elsewhere(options.launch, world))
    check_hub_data(recipe.data, recipe_file, options.overrides)  # offline: fail now, not inside the ranks
    if options.dry_run and under_torchrun():
        raise UserError("--dry-run: this process is already a rank that torchrun started; run it outside "
                        "torchrun to see the launch")
    # torch from here on: the recipe and the arguments are known to be good. The ranks' server imports it too.
    # `holding` keeps the run directory this launch claims until its ranks have ended.
    with contextlib.ExitStack() as holding, \
            contextlib.nullcontext() if options.dry_run else warming(options.launch, local):  # no rank to fork
        return _plan_and_run(options, recipe, recipe_file, world, local, started, holding)


def claims(options: LaunchOptions, world: int) -> bool:
    """Whether this process claims the job's run directory: rank 0 under torchrun, else rank 0's node's launcher."""
    # Every rank under torchrun runs this command, and every node's launcher on several nodes, where only rank 0
    # writes the run; a launcher knows it starts rank 0 on a job's one node, or as node 0 of a static rendezvous.
    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    rdzv = rendezvous(world, options)
    return rdzv.max_nodes == 1 or rdzv.node_rank == 0


def claimed_elsewhere(options: LaunchOptions, world: int) -> bool:
    """Whether another process of this job claims its run directory: rank 0 under torchrun, or node 0's launcher."""
    # With c10d no launcher knows whether it starts rank 0, and none claims: a holder is another job.
    return not claims(options, world) and (under_torchrun() or rendezvous(world, options).node_rank is not None)


def _claim(options: TrainOptions, recipe: Recipe, resume: str | None, holding: contextlib.ExitStack) -> Path | None:
    """Hold this launch's run directory until `holding` closes; the directory when it was made for this run."""
    made, parents = False, missing(Path(OUTPUTS, recipe.name))
    if options.output_dir:  # a bare --resume continues, or starts, the run there
        run_dir, flag, instead = Path(options.output_dir), "--output-dir", "wait until it ends, or give another " \
            "--output-dir"
    elif resume is not None:
        run_dir, flag, instead = run_dir_of(resume), "--resume", "wait until it ends"
    else:  # made at once, so that two runs started in the same second never share one
        run_dir, flag, instead = choose_run_dir(recipe, None, OUTPUTS, make=True), "the output directory", \
            "wait until it ends"
        made = True
    if holding.enter_context(held(run_dir, flag, instead, made, parents if made else ())):
        return run_dir
    # A folder that was there (the user's, or a run's): a launch that ends before the first step takes out only
    # what it added, while the claim still holds it.
    with contextlib.suppress(OSError):  # an unreadable folder: the checks that follow refuse it
        holding.callback(remove_set_up, run_dir, frozenset(os.listdir(run_dir)))
    return None


def _fresh_line(output_dir: str | None, dropped: bool) -> str:
    """What a bare --resume does with an --output-dir that holds no checkpoint (`dropped`: but records of steps)."""
    said = ("holds no checkpoint yet; the run starts there again from step 0 (the steps it recorded are dropped)"
            if dropped else "holds no run yet; starting a new one there")
    return f"--resume: {shown_path(str(output_dir))} {said}"


def _plan_and_run(options: TrainOptions, recipe: Recipe, recipe_file: str | None, world: int, local: int,
                  started: float, holding: contextlib.ExitStack) -> int:
    """Check the plan (and a resume) against this machine, say what starts, and run the ranks; the exit code."""
    first = not under_torchrun() or os.environ.get("RANK", "0") == "0"
    live = options.plain is False or (options.plain is None and redraws(sys.stdout))
    if options.dry_run:  # the same checks, then the launch in place of the run's lines
        first = live = False
    if first and not live:  # lines: say what starts now, and what the seconds to the next line do; a plan error
        say(f"{first_line(recipe)}; checking the plan", sys.stdout)  # follows on stderr, still one line there
    with checking(recipe, first and live):
        import torch  # and the models: the status line is already up

        from gpipe_cli import memory_model
        from gpipe_cli.train.plan import checked_plan

        interrupts.check()  # a Ctrl-C that torch's import swallowed stops now, not after seconds of planning
        check_device(recipe.pipeline.backend, recipe.train.device, int(os.environ.get("LOCAL_WORLD_SIZE", local)),
                     typed_values(options.overrides), recipe_label(recipe_file))
        # Refuses impossible cuts and plans that cannot fit, before any rank starts. The ranks cut for the
        # memory free now, not for what is left while their siblings load.
        available = float(memory_model.available_bytes("cuda" if torch.cuda.is_available() else "cpu"))
        checked_plan(recipe, recipe_label(recipe_file), must_fit=not under_torchrun(), available=available,
                     sets=options.overrides)
        resume = resume_location(options.resume, options.output_dir, recipe.name, OUTPUTS) if options.resume else None
        # Held from here until the ranks end, and what follows judged under the claim: a run that another launch
        # finished meanwhile is found, and one it is writing refuses this launch.
        claimed = not options.dry_run and claims(options.launch, world)
        new_dir = _claim(options, recipe, resume, holding) if claimed else None
        if options.output_dir and starts_anew(options.resume, options.output_dir):
            check_new_run_dir(Path(options.output_dir), ours=claimed or claimed_elsewhere(options.launch, world))
        fresh = resume is not None and options.resume == "latest" and options.output_dir is not None \
            and not candidates(Path(options.output_dir))  # no checkpoint at all; a damaged one is refused below
        if fresh:  # a scheduler's first launch of a job that resumes when requeued: nothing to continue yet
            resume = None
        # A launch that ended before its first checkpoint left records of steps no resume can continue. Its claimant
        # drops them: under torchrun the other ranks would rewrite the file beside it.
        dropped = bool(fresh and options.output_dir and holds_run(Path(options.output_dir)))
        if dropped and options.output_dir and claimed:
            from gpipe_cli.train.resume import trim_metrics

            trim_metrics(Path(options.output_dir) / METRICS, 0)
        changes: list[Change] | None = None
        base: Path | None = None
        complete: int | None = None
        step: int | None = None
        if resume is not None:
            check_writable(Path(resume), "--resume")
            step = check_resumable(resume)
            base = settings_of(resume)
            changes = recipe_changes(recipe, base)
            check_checkpoint_keys(recipe, held_changes(recipe, resume) or changes or [], resume)
            check_tokenizer_kept(recipe, resume)
            complete = resume_end(recipe, resume)
        elif fresh and options.output_dir:
            check_writable(Path(options.output_dir), "--output-dir")
    # At its end and not complete: a stop cut its final evaluation short, which the ranks make, and nothing else.
    only_evaluates = (resume is not None and complete is None and step is not None
                      and recipe.train.epochs is None and step == recipe.train.steps)
    evaluating = ", to make its final evaluation, which a stop cut short" if only_evaluates else ""
    if options.dry_run:  # every check a launch makes has passed: what it would start, and nothing else
        shape = f"K={recipe.pipeline.partitions} x D={recipe.pipeline.data_parallel}"
        print("\n".join(dry_run_lines(options.launch, world, shape, train_args(options))), flush=True)
        if complete is not None:  # what the launch would say, and then start nothing
            say(complete_line(run_dir_of(str(resume)), complete, f"train.steps {recipe.train.steps}",
                              earlier=earlier_checkpoint(str(resume))), sys.stdout)
        elif resume is not None:  # which run, from which step, with which changes: a bare --resume picks one
            say(resume_line(run_dir_of(resume), step, changes, options.recipe, options.recipe is None,
                            options.overrides, base) + (settings_unkept(resume) if options.recipe is None else "")
                + evaluating, sys.stdout)
        elif fresh:
            say(_fresh_line(options.output_dir, dropped), sys.stdout)
        warning = node_oversubscribed(recipe, options.launch.nnodes, options.launch.threads)
        if warning:
            say(warning, sys.stdout)
        for line in filter(None, [recipe_kind_note(recipe_file, options.overrides), *unread_settings(recipe)]):
            say(f"note: {line}", sys.stdout)  # what the launch would note, as validate words it
        return 0
    if complete is not None:  # e.g. a scheduler requeued a finished job: say so, touch nothing
        if first:
            say(complete_line(run_dir_of(str(resume)), complete, f"train.steps {recipe.train.steps}",
                              earlier=earlier_checkpoint(str(resume))), sys.stdout)
        return 0
    if first:
        announce(recipe, options.launch.nnodes, options.launch.threads, sys.stdout, said=not live)
        if recipe.train.precision == "fp16" and (recipe.train.device == "cpu" or not torch.cuda.is_available()):
            say(note(started, "note: train.precision fp16 on a CPU: most CPUs have no fast float16 arithmetic, and "
                              "fp32 usually runs faster here"), sys.stdout)
        for line in filter(None, [recipe_kind_note(recipe_file, options.overrides), *unread_settings(recipe)]):
            say(note(started, f"note: {line}"), sys.stdout)  # as validate and the dry run word it
        if fresh:
            say(note(started, _fresh_line(options.output_dir, dropped)), sys.stdout)
        if resume is not None:  # before any rank starts: the run's recipe.yaml will record what it changes
            continued = options.recipe is None
            say(resume_line(run_dir_of(resume), step, changes, options.recipe, continued, options.overrides, base)
                + (settings_unkept(resume) if continued else "") + evaluating, sys.stdout)
    job = Job(recipe=recipe.model_dump(mode="json"), output_dir=options.output_dir, plain=options.plain,
              resume=resume, started=started, available=available, run_dir=str(new_dir) if new_dir else None)
    if under_torchrun():
        from gpipe_cli.train.worker import run_job

        return run_job(job)
    here = local_ranks(world, options.launch.nnodes)
    say(note(started, f"starting {counted(here, 'rank')}"
                      + (f" of {world} on this node" if here != world else "")), sys.stdout)
    try:
        with tempfile.TemporaryDirectory(prefix="gpipe-") as folder:
            path = Path(folder) / "job.json"
            path.write_text(json.dumps(dataclasses.asdict(job)))
            code = launch("gpipe_cli.train.worker", [str(path)], world, options.launch,
                          stages=recipe.pipeline.partitions, started=Path(folder) / STARTED)
            interrupts.ignore_stops()  # the ranks have ended and said how: a stop now has nothing left to stop
            return code
    except KeyboardInterrupt as stop:  # a stop again while the ranks ended: not "nothing was written"
        interrupts.ignore_stops()  # stops keep coming (a key held down): this line is said whole
        run_dir = new_dir or options.output_dir or (run_dir_of(resume) if resume else None)
        # A node stopped while it waited for node 0 wrote nothing, whatever the run it would resume holds.
        if run_dir is None or isinstance(stop, NothingStarted) or not holds_run(Path(run_dir)):
            raise
        on = f"; continue with {continue_command(Path(run_dir), node_flags(options.launch))}" \
            if candidates(Path(run_dir)) else ""
        print(f"gpipe train: interrupted; {run_dir} keeps what the run wrote{on}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
