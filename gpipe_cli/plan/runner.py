"""`gpipe plan`: measure the recipe's model once, search how to run it on N devices, print and write the best."""

from __future__ import annotations

import functools
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe_cli import interrupts
from gpipe_cli.errors import UserError, path_line, shell_path, shown_path
from gpipe_cli.files import another_file, check_not_input, check_output, holds_no
from gpipe_cli.plan.options import ASSUMED_BANDWIDTH, ASSUMED_LATENCY_US, PlanOptions, validate
from gpipe_cli.recipe.load import default_recipe_text, load_recipe, parse_yaml, recipe_label, recipe_read
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe.yamlio import MAX_RECIPE_BYTES, parse_document, read_recipe_file
from gpipe_cli.units import counted, human_bytes, human_seconds, size_flag

if TYPE_CHECKING:
    from gpipe_cli.models.base import ModelSpec

_BARE = re.compile(r"\s*[0-9.]+\s*")  # a size typed without a unit


def micro_sizes(layers: int, batch: int, devices: int, least: int) -> list[int]:
    """Every micro-batch size the search can try: batch / D / M for K | N, K <= layers, D | batch, M | batch / D."""
    from gpipe_cli.plan.search import divisors

    replicas = [devices // k for k in divisors(devices) if k <= layers]
    return sorted({s for d in replicas if batch % d == 0 for s in divisors(batch // d) if s >= least})


def as_written_line(model: Any, hw: Any, recipe: Recipe, best: Any, budget: float) -> str:
    """The recipe's own pipeline settings predicted as the pick is, for beside it, or why they cannot be."""
    # A balance named by a mode is cut by measured time, as the search cuts.
    from gpipe_cli.plan import search, show

    p = recipe.pipeline
    config = search.Config(p.partitions, p.data_parallel, p.microbatches, p.schedule, p.virtual_stages, p.checkpoint,
                           p.offload)
    why = _not_comparable(model, hw, recipe)
    if why is not None:
        return f"the recipe as written ({config.label()}) is not compared: {why}"
    written = search.evaluate(model, hw, config, p.balance if isinstance(p.balance, list) else None)
    gain = best.samples_per_s / written.samples_per_s - 1.0 if written.samples_per_s else 0.0
    fit_note = "" if written.fits else f", does not fit: {show.reason(model, best, written, budget)}"
    return (f"the recipe as written ({config.label()}, balance {','.join(map(str, written.balance))}): "
            f"predicted {show.rate(written.samples_per_s)} samples/s{fit_note}; the plan's pick is predicted "
            f"{gain * 100:+.0f}%")


def _not_comparable(model: Any, hw: Any, recipe: Recipe) -> str | None:
    """Why the recipe's own pipeline settings cannot be predicted for these devices (None: they can)."""
    from gpipe_cli.pipeline import partition, schedule
    from gpipe_cli.recipe_model import batch_words

    p = recipe.pipeline
    used = p.partitions * p.data_parallel
    if used != hw.devices:
        return (f"it uses K x D = {p.partitions} x {p.data_parallel} = {used} devices, not the {hw.devices} "
                f"planned for")
    if model.batch % p.data_parallel:
        return f"{batch_words(recipe)} is not a multiple of D={p.data_parallel}"
    if model.batch // p.data_parallel < p.microbatches:
        share = model.batch // p.data_parallel
        return f"each replica's {counted(share, 'example')} cannot make M={p.microbatches} micro-batches"
    chunks = p.partitions * p.virtual_stages
    try:
        schedule.check(p.schedule, p.partitions, p.microbatches, p.virtual_stages)
        if isinstance(p.balance, list):
            partition.check_balance(p.balance, model.layers, chunks)
        else:
            partition.check_chunks(model.layers, p.partitions, p.virtual_stages)
    except ValueError as exc:  # PartitionError among them
        return str(exc)
    return None


def run(options: PlanOptions) -> int:
    """Run `gpipe plan` and write the recipe when asked (UserError: what cannot be planned)."""
    validate(options)
    # Its M and D need not fit a smaller --batch-size: they are the plan's to pick (the line comparing the recipe
    # as written says why they cannot run).
    recipe = load_recipe(options.recipe, options.set, check_data=False, planning=True)
    # The recipe's text, and its data with the --set overrides: written back with a new pipeline section.
    text = default_recipe_text() if options.recipe is None else read_recipe_file(Path(options.recipe))
    raw = parse_yaml(text, recipe_label(options.recipe), options.set)
    check_output(options.output, "--output", "planned.yaml")
    _not_the_recipe(options)
    _only_a_recipe_replaced(options.output)
    with interrupts.remembered():
        from gpipe_cli.plan.here import siblings  # torch

        with siblings():  # the processes that measure beside this one fork from one server
            finish = _plan(options, recipe, (text, raw))
        # A Ctrl-C that a library swallowed while it loaded (torch's import does) is remembered only:
        # without this, a plan that measures nothing would go on to write --output after it.
        interrupts.check()
    # Planned: from here on a Ctrl-C or SIGTERM waits the moment it takes to write --output and say so,
    # rather than claim that nothing was written after it was (outside `remembered`, which would undo it).
    interrupts.finishing()
    return finish()


def _check_weights_fit(spec: ModelSpec, bytes_per_param: float, budget: float, devices: int,
                       options: PlanOptions) -> None:
    """Refuse a --device-memory below what the weights, gradients and optimizer state alone need on any cut."""
    from gpipe_cli.models.describe import count_parameters, layer_params

    # A bound no plan goes under: a layer is never split, and at most min(N, layers) stages share the model.
    largest = max(layer_params(spec)) * bytes_per_param
    shared = count_parameters(spec) * bytes_per_param / min(devices, len(spec.layers))
    floor = max(largest, shared)
    if budget < floor:
        raise UserError(f"{_nothing_fits(budget, devices, options)}: the weights, gradients and optimizer state "
                        f"alone need more than {human_bytes(floor, up=True)} per device, however the model is cut; "
                        f"give a --device-memory above that (activations need more)"
                        f"{', with its unit, e.g. 80GiB' if _BARE.fullmatch(options.device_memory or '') else ''}, "
                        "or more --devices")


def _nothing_fits(budget: float, devices: int, options: PlanOptions) -> str:
    """How a refusal for memory begins, saying when --device-memory was typed without a unit (`80` for 80 GiB)."""
    bare = " (a number without a unit is bytes)" if _BARE.fullmatch(options.device_memory or "") else ""
    return f"nothing fits {human_bytes(budget)} per device on {counted(devices, 'device')}{bare}"


def _not_the_recipe(options: PlanOptions) -> None:
    """Refuse an --output that is the input recipe itself (or, for the built-in one, its copy in recipes/): the plan
    would replace it, comments and all."""
    output, recipe = options.output, options.recipe
    if output is None:
        return
    instead = another_file(output, output.stem + ".planned.yaml")
    check_not_input(output, "--output", [recipe_read(recipe)], instead)
    if recipe is not None or not output.is_file():
        return
    try:  # without a recipe the built-in one is planned: a checkout ships it as recipes/quickstart.yaml too
        copy = output.read_text(errors="replace") == default_recipe_text()
    except OSError:  # it vanished or cannot be read: the write itself then says what is wrong
        return
    if copy:
        raise UserError(f"--output {shown_path(str(output))} is the built-in recipe being planned: writing there would "
                        f"replace it; {instead}")


def _only_a_recipe_replaced(output: Path | None) -> None:
    """Refuse an existing --output that is not a recipe (`compose.yaml`, notes): the plan would replace it."""
    if output is None or not output.is_file():
        return
    try:
        text = output.read_text() if output.stat().st_size <= MAX_RECIPE_BYTES else None
        data = parse_document(text, str(output)) if text is not None else []
    except (OSError, UnicodeDecodeError, UserError):  # unreadable as a recipe: another kind of file
        data = []
    if data is None or (isinstance(data, dict) and data and set(map(str, data)) <= Recipe.model_fields.keys()):
        return  # empty, or a recipe: another plan written before, perhaps
    raise holds_no(output, "--output", "recipe", another_file(output, output.stem + ".planned.yaml"))


def _plan(options: PlanOptions, recipe: Recipe, source: tuple[str, dict[str, Any]]) -> Callable[[], int]:
    """Measure, search and print the plan; what is left to do once it is printed: write --output."""
    # torch from here on: the arguments and the recipe are valid
    import torch

    from gpipe_cli import contention, sizing
    from gpipe_cli import memory_model as mm
    from gpipe_cli.console import output_console
    from gpipe_cli.contention import usable_cores
    from gpipe_cli.estimate import kept
    from gpipe_cli.estimate.simulate import Link
    from gpipe_cli.plan import inputs, search, show
    from gpipe_cli.progress import Progress, took_line
    from gpipe_cli.recipe_model import batch_key, batch_words, model_spec, optimizer_name, priced_batch

    interrupts.check()  # one that arrived while torch loaded, which swallows it: stop before any work
    started = time.perf_counter()
    console = output_console()
    spec = model_spec(recipe)
    batch, n = priced_batch(recipe), options.devices
    layers = len(spec.layers)
    if not micro_sizes(layers, batch, n, 1):
        raise UserError(f"--devices {n}: no pipeline uses exactly {n} devices: K stages x D replicas = {n} needs "
                        f"K <= the model's {layers} pipeline layers and D dividing {batch_words(recipe)}")
    per_node = n // options.nodes
    threads = max(1, usable_cores() // per_node)
    memory = options.memory_bytes()
    budget = float(memory) if memory is not None else mm.capacity(per_node).per_rank_bytes

    def sizes(least: int) -> tuple[int, int]:
        found = micro_sizes(layers, batch, n, least) or [least]
        return found[0], found[-1]

    def say(text: str) -> None:
        console.print(f"[dim]{text}[/]", highlight=False)

    # The plan's estimate is its phases' (each known only once the one before has measured what it needs), after the
    # time its first phase finds already spent (reading the data, sizing the model), which it need not guess.
    progress = Progress(say)

    def phase(what: str, seconds: float) -> None:
        if not progress.estimated:
            progress.estimated = time.perf_counter() - started
        progress.phase(what, seconds, add=True)

    device = "cuda" if recipe.train.device != "cpu" and torch.cuda.is_available() else "cpu"  # as training picks
    # Ranks of one node that compute at once on this machine's cores; GPUs do not share them.
    here_ranks = min(per_node, max(usable_cores(), 1)) if device == "cpu" else 1
    if device == "cpu" and per_node > here_ranks and options.tflops is None:  # as train and bench warn of it
        console.print(f"[yellow]warning: {per_node} ranks per node on this machine's {here_ranks} CPU "
                      f"core{'s' if here_ranks > 1 else ''} would take turns on them (oversubscribed); the plan "
                      f"predicts each with a core of its own, so training here will be slower than it says[/]",
                      highlight=False)
    measuring = options.tflops is None and options.timing != "estimate"
    if measuring and memory is not None:  # now, not after the minutes of measuring; estimating takes a moment
        _check_weights_fit(spec, kept.bytes_per_parameter(optimizer_name(recipe)), budget, n, options)
    sample = _sample(recipe, say) if measuring else None
    link, reduce_link, link_note = _links(options, measuring and here_ranks > 1, here_ranks, say, phase)
    if not measuring:  # else the data's, the links' or the layers' phase comes first
        say(f"pricing the {layers} pipeline layers from their shapes and FLOPs (meta device)...")
    fed = inputs.inputs(recipe, options, sizes, threads, say, phase, sample, here_ranks - 1,
                        (link, reduce_link) if reduce_link else None, device)
    model = fed.model
    hw = search.Hardware(n, budget, link, Link.of(options.node_bandwidth, options.node_latency_us), options.nodes,
                         reduce_link)
    phase("searching every K, D, M, schedule, V, remat, offload and balance for the fastest that fits",
          search.search_seconds(model, hw, sizing.measured_call()))
    result = search.search(model, hw)
    evaluated = len(result.ranked) + len(result.refused)
    if not evaluated:
        raise UserError(f"--devices {n}: no pipeline uses exactly {n} devices with micro-batches of at least "
                        f"{model.min_microbatch} examples ({batch_words(recipe)})")
    best = result.best
    if best is None:
        assert result.smallest is not None and result.smallest_memory is not None
        needed = result.smallest_memory
        raise UserError(f"{_nothing_fits(budget, n, options)}: the smallest plan ({result.smallest.config.label()}) "
                        f"needs {human_bytes(needed, up=True)} per device (predicted); give --device-memory "
                        f"{size_flag(needed)} or more, more --devices, or a smaller {batch_key(recipe)}")
    where = "this machine's per-rank memory" if memory is None else "--device-memory"
    node_text = f" on {options.nodes} nodes" if options.nodes > 1 else ""
    line = functools.partial(console.print, highlight=False)
    if any(contention.contended(load) for load in fed.loads.values()):  # the speed figures that follow
        line(contention.note(fed.loads))
    line(f"[bold]gpipe plan[/] · {spec.name} ({layers} pipeline layers) · {counted(n, 'device')}{node_text}, "
         f"{human_bytes(budget)} each ({where}) · "
         f"{f'batch {batch}' if recipe.data.tokens_per_batch is None else batch_words(recipe)}")
    line(f"  per-layer seconds: {fed.timing}")
    if fed.drift is not None:
        line(f"  steadiness: {steadiness(fed.drift)}")
    line(f"  memory: the memory model, {fed.memory}; {model.bytes_per_param:.0f} bytes per parameter "
         f"({optimizer_name(recipe)})")
    node_note = (f", between nodes (assumed) {options.node_bandwidth:g} GB/s and {options.node_latency_us:g} µs"
                 if options.nodes > 1 else "")
    line(f"  links: {link_note}{node_note}")
    line(f"  searched {evaluated} configurations (K, D, M, schedule, V, remat, offload; balance: min-max time among "
         f"cuts that fit): {len(result.ranked)} fit")
    items = show.rows(model, result, options.top, budget)
    title = "predictions (simulated from the per-layer seconds; not measured)"
    if options.plain:
        line(show.plain(items, title), markup=False)
    else:
        show.print_plan(console, items, title)
    line(as_written_line(model, hw, recipe, best, budget))
    section = show.pipeline_section(best, recipe.pipeline.backend)
    target = shell_path(options.recipe) if options.recipe is not None else ""
    # The settings typed for the model and data (by --set or a size flag) travel with it; its pipeline is the plan's.
    carried = [f"--set {shlex.quote(item)}" for item in options.set if not item.lstrip().startswith("pipeline.")]
    command = " ".join(["gpipe train", *([target] if target else []), *carried, *show.set_lines(section)])
    line(f"predicted best: {best.config.label()}, {show.rate(best.samples_per_s)} samples/s. Train it with:")
    line(f"  {command}", markup=False, soft_wrap=True)
    header = show.header_line(n, budget, best)

    def finish() -> int:
        """Write --output when asked, and say how long the plan took."""
        if options.output is not None:
            try:
                show.write_recipe(*source, section, options.output, recipe_label(options.recipe), header)
            except OSError as exc:  # a disk can fill, or a folder change, after the check; nothing is half there
                raise UserError(f"--output: cannot write {shown_path(str(options.output))} ({exc.strerror or exc})") \
                    from None
            line(f"wrote {path_line(options.output)}; train with: gpipe train {shell_path(options.output)}",
                 markup=False)
        console.print(f"[dim]{took_line(time.perf_counter() - started, progress.estimated)}[/]"
                      if progress.estimated else f"[dim]took {human_seconds(time.perf_counter() - started)}[/]")
        return 0

    return finish


UNSTEADY = 0.10  # a step that moved more than this while measuring makes the predictions that uncertain


def steadiness(drift: float) -> str:
    """What the repeated engine step says of this machine's speed while the plan measured."""
    moved = f"the first engine step, timed again at the end, took {abs(drift) * 100:.0f}% " \
            f"{'longer' if drift > 0 else 'less'}"
    if abs(drift) <= UNSTEADY:
        return f"{moved}: steady while measuring"
    return (f"{moved}: this machine's speed moved while measuring, and the predictions may be off by as much; "
            f"plan again on a quieter machine, or compare the pick and the runner-up with gpipe bench")


def _sample(recipe: Recipe, say: Any) -> Any:
    """The recipe's own data to time on, or None (said) when it cannot be loaded here."""
    from gpipe_cli.plan.sample import typical_batch

    say("reading the recipe's training data (its mini-batches' shapes are what the layers are timed on)...")
    try:
        return typical_batch(recipe)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # any failure leaves generated examples; planning goes on
        interrupts.check()  # unless a Ctrl-C caused it, in a library that turned it into an error of its own
        # Whole: its end is often the fix (the command that prepares the data offline).
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        say(f"the recipe's data could not be read here ({why}); timing generated examples of full length")
        return None


def _links(options: PlanOptions, measure: bool, ranks: int, say: Any, phase: Any) -> tuple[Any, Any, str]:
    """The link within a node and the all-reduce's (measured between ranks here unless given), and their line."""
    from gpipe_cli.estimate.simulate import Link
    from gpipe_cli.plan import here

    if measure and options.bandwidth is None and options.latency_us is None:
        # Starting the ranks, then a few hundred messages of up to 4 MiB.
        phase(f"measuring the links between {ranks} ranks here (gloo)", here.start_seconds(max(ranks, 2)) + 1.0)
        try:
            p2p, reduce = here.links(ranks)
        except here.Unavailable as exc:
            say(f"{exc}; assuming the links instead")
            return _links(options, False, ranks, say, phase)
        interrupts.check()
        return p2p, reduce, (f"measured between {ranks} ranks here: {p2p.bandwidth / 1e9:.2f} GB/s and "
                             f"{p2p.latency * 1e6:.0f} µs per message, all-reduce {reduce.bandwidth / 1e9:.2f} GB/s "
                             f"and {reduce.latency * 1e6:.0f} µs per ring step")
    gb = ASSUMED_BANDWIDTH if options.bandwidth is None else options.bandwidth
    us = ASSUMED_LATENCY_US if options.latency_us is None else options.latency_us
    link = Link.of(gb, us)
    return link, None, f"{gb:g} GB/s and {us:g} µs per message within a node (assumed)"
