"""`gpipe profile-memory`: per-stage memory of naive-1, pipeline-1 and pipeline-K, or the largest model per K."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console

from gpipe_cli import contention, interrupts, sizing
from gpipe_cli import memory_model as mm
from gpipe_cli.console import output_console
from gpipe_cli.errors import UserError
from gpipe_cli.estimate import kept
from gpipe_cli.estimate.subject import (
    FAMILIES,
    SIZE_PARAMS,
    Subject,
    check_limits,
    example_batch,
    model_overrides,
    naming_the_sized,
    paced,
    resolve,
    to_measure,
    unknown_param,
)
from gpipe_cli.files import write_json
from gpipe_cli.limits import refuse
from gpipe_cli.models import families
from gpipe_cli.models.describe import count_parameters, layer_params
from gpipe_cli.models.registry import allowed_params, build_model
from gpipe_cli.pipeline.partition import PartitionError
from gpipe_cli.profile import account, budget, probe, scenarios, tables
from gpipe_cli.profile.options import ProfileOptions
from gpipe_cli.progress import Progress
from gpipe_cli.units import flop_rate, human_bytes, human_count, human_seconds, parse_size


def _device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")


# Besides its rows: loading, sizing and shaping the model on the meta device, and the ranks-free set-up.
FIXED_S = 3.0
# Pricing a layer from its shapes: 19 to 32 ms each on a 2-core CPU (Transformers of 102 to 602 layers, d_model
# 64 to 65536), whatever its width.
MANY_LAYERS, SHAPE_S_PER_LAYER = 100, 0.03


def row_seconds(cand: sizing.Candidate, machine: sizing.Machine, batch: int, microbatches: int,
                checkpoint: str) -> float:
    """Seconds measuring one row takes: one training step, and building its layers and optimizer state."""
    work = sizing.step_seconds(cand, machine, batch, microbatches, sizing.passes(checkpoint))
    return work + 0.5 + cand.parameters * BUILD_S


# Seconds per parameter of building a stage: initialising its weights and the optimizer's state. Measured on
# a 2-core CPU at 42M parameters (about 0.5 s per row).
BUILD_S = 1.2e-8


def probe_seconds(cand: sizing.Candidate, machine: sizing.Machine) -> float:
    """Seconds measuring per-layer figures takes: each layer's forward and backward at two small batches."""
    return 2 * sizing.step_seconds(cand, machine, 6, 1, 2.0)


def _subject(options: ProfileOptions, machine: sizing.Machine, batch: int,
             say: Callable[[str], None]) -> tuple[Subject, str, bool]:
    """The model (sized to the machine without model flags), the announcement, and whether it was sized."""
    rows = scenarios.names(options.partitions, options.microbatches, options.checkpoint)
    per_param = kept.bytes_per_parameter(options.optimizer)

    def judge(cand: sizing.Candidate) -> sizing.Verdict:
        # naive-1 holds the whole model and the whole batch's activations: it must fit to be measured.
        def need() -> float:
            return scenarios.naive_bytes(kept.figures(build_model(cand.kind, **cand.params)), batch, per_param)

        # One step per row (each stage driven in turn) and the per-layer probes.
        seconds = FIXED_S + probe_seconds(cand, machine) + sum(
            row_seconds(cand, machine, batch, m, checkpoint) for _, _, m, checkpoint in rows)
        return sizing.Verdict(need, machine.memory_bytes * sizing.MEMORY_SHARE, seconds, sizing.TIME_BUDGET_S)

    # Left to this machine: a family name and no size flag or --set.
    sized = options.model in FAMILIES and all(v is None for v in options.sizes().values()) and not options.set
    return *to_measure(options.model, options.sizes(), options.set, judge, max(options.partitions), sized,
                        say=say)[:2], sized


def measure(options: ProfileOptions, console: Console, progress: Progress | None = None) -> dict[str, Any]:
    """Decide every row, print the plan, then measure what can be and extrapolate the rest, each phase on `progress`."""
    progress = progress or Progress(lambda line: console.print(f"[dim]{line}[/]", highlight=False))
    device = _device(options.device)
    m = options.microbatches
    batch = options.batch_size or 4 * m
    machine = sizing.this_machine(torch.get_num_threads())
    per_param = kept.bytes_per_parameter(options.optimizer)
    have = float(mm.available_bytes(device)) * sizing.MEMORY_SHARE
    names = scenarios.names(options.partitions, m, options.checkpoint)
    for again in (False, True):
        subject, note, sized = _subject(options, machine, batch,
                                        (lambda line: progress.say(f"again, at this pace: {line}")) if again
                                        else progress.say)
        spec = subject.build()
        # Per-layer figures from shapes first (quick at any width), to decide and announce every row.
        if len(spec.layers) > MANY_LAYERS:  # else a deep model's pricing is a silence of minutes
            progress.phase(f"pricing {len(spec.layers):,} layers from their shapes (meta device)",
                           SHAPE_S_PER_LAYER * len(spec.layers))
        figures = kept.figures(spec)
        try:
            rows = scenarios.choose_rows(spec, figures, names, batch, options.schedule, per_param, have,
                                         options.balance, options.offload, options.virtual_stages)
        except PartitionError as exc:
            message = f"{options.cut_named()}: {exc}"
            raise UserError(naming_the_sized(message, subject) if sized else message) from None
        cand = sizing.candidate(subject.kind, subject.params)
        probe_s = probe_seconds(cand, machine)
        probing = any(not sc.measured for sc in rows) and probe_s < 30 and max(layer_params(spec)) * per_param < have
        timed = device.type == "cpu" and any(sc.measured for sc in rows)  # the model fits: a layer can be timed
        if timed:
            # A quarter of the batch: large enough that the arithmetic, not each call's fixed cost, sets the time
            # (within a fifth of the whole batch's rate on a 2-core CPU), at a fifth of the cost.
            machine = paced(machine, spec, subject.kind, min(max(batch // 4, 2), batch), options.seed, progress.say)
            probe_s = probe_seconds(cand, machine)
        # Now that every row is decided: what this profile runs, not what sizing assumed (every row measured),
        # and the set-up as long as it took.
        seconds = max(FIXED_S, progress.elapsed()) + (probe_s if probing else 0.0) + sum(
            row_seconds(cand, machine, batch, sc.microbatches, sc.checkpoint) for sc in rows if sc.measured)
        # A model sized by the quick rate, which a busy machine's layers fall far below, is sized once more by the
        # rate its layers reach (once: the smaller member's estimate stands as it is).
        if again or not (sized and timed) or seconds <= sizing.TIME_BUDGET_S:
            break
    predicted = [sc.predict(figures, batch, per_param) for sc in rows]
    if note:
        console.print(f"[bold]{note}[/]")
    if contention.contended(machine.load):  # the rate below, and the estimates from it
        console.print(contention.note({contention.RATE: machine.load}), highlight=False)
    name = cand.describe(full=True) if "layers" in subject.params else spec.name
    console.print(f"[bold]plan[/] · {name}: {human_count(cand.parameters)} parameters, {len(spec.layers)} "
                  f"pipeline layers · {human_bytes(have / sizing.MEMORY_SHARE)} free on {device}")
    for sc, prints in zip(rows, predicted):
        how = "measure" if sc.measured else "extrapolate"
        per_stage = " · ".join(human_bytes(fp.total_bytes) for fp in prints)
        console.print(f"  {sc.name:<11} {how:<11} balance {sc.balance}: per stage (est.) {per_stage}")
    console.print(f"  estimate: about {human_seconds(seconds)} (this machine: "
                  f"{flop_rate(machine.flops_per_s)} measured)")
    progress.estimated = seconds
    source = "saved-tensor accounting of each layer's forward on the meta device (shapes only)"
    if probing:
        # Extrapolate from per-layer figures measured on this device, one layer at a time.
        progress.phase("measuring per-layer figures", probe_s)
        figures = mm.measure(spec, options.seed, device=str(device))
        interrupts.check()
        rows = scenarios.choose_rows(spec, figures, names, batch, options.schedule, per_param, have, options.balance,
                                     options.offload, options.virtual_stages)
        source = f"saved-tensor accounting of each layer's forward and backward on {device}"
    correction = None
    if device.type == "cuda" and any(not sc.measured for sc in rows):  # the extrapolated rows are predicted
        correction = _calibrate(member_probes(subject, names, options.schedule, options.optimizer, options.seed,
                                              probe_room(device)), subject.kind, machine, device, console, progress)
    inputs, targets = example_batch(spec, batch, options.seed)
    params = count_parameters(spec)  # a tied weight once, as the plan line says
    out = []
    for sc in rows:
        if sc.measured:
            seconds_here = row_seconds(cand, machine, batch, sc.microbatches, sc.checkpoint)
            progress.phase(f"measuring {sc.name} (balance {sc.balance})", seconds_here)
            stages = [s.to_json() for s in account.measure(spec, inputs, targets, sc.balance, sc.microbatches,
                                                           sc.schedule, sc.checkpoint, options.optimizer,
                                                           options.seed, device, sc.offload, sc.virtual)]
            interrupts.check()
            out.append(scenarios.row(sc, stages, params))
        else:
            stages = scenarios.predicted_stages(sc, figures, batch, per_param)
            priced = sc.figures or figures
            out.append(scenarios.row(sc, stages, priced.params([range(len(priced.layers))])))
            if correction is not None:  # what the device holds, beside the accounting
                device_bytes = [correction.bytes(fp, sc.checkpoint)
                                for fp in sc.predict(figures, batch, per_param)]
                out[-1].update(accounted_peak_bytes=out[-1]["device_peak_bytes"], device_peak_bytes=max(device_bytes))
    return {"model": {**subject.to_json(), "name": spec.name, "layers": len(spec.layers), "tied": bool(spec.tied)},
            "batch_size": batch,
            "microbatches": m, "schedule": options.schedule, "checkpoint": options.checkpoint,
            "offload": options.offload, "optimizer": options.optimizer, "device": str(device),
            "method": account.method(device),
            "sized": note, "estimate_s": seconds, "per_layer_figures": source, "scenarios": out,
            "correction": None if correction is None else correction.to_json()}


def probe_room(device: torch.device) -> float | None:
    """The bytes one probe step may take on `device`: a quarter of a GPU's free memory (None on the CPU, whose
    meter is the accounting itself, without an update's peak to hide the activations)."""
    return mm.available_bytes(device) / 4 if device.type == "cuda" else None


def member_probes(subject: Subject, rows: list[tuple[str, int, int, str]], schedule: str, optimizer: str,
                  seed: int, room: float | None = None) -> list[probe.Probe]:
    """The device probe's steps for a given model: two shallow members of it, with its widths."""
    params = [{**subject.params, "layers": depth} for depth in families.of(subject.kind).device_probe_depths]
    specs = [build_model(subject.kind, **p) for p in params]
    members = [(spec, kept.figures(spec), p) for spec, p in zip(specs, params)]
    return probe.steps(members, rows, subject.kind, schedule, optimizer, seed, room)


def _family(options: ProfileOptions) -> tuple[str, dict[str, Any]]:
    """The family --budget searches and its fixed parameters: the paper's, with --set and the size flags."""
    kind = resolve(options.model, {}, ()).kind
    fixed = dict(budget.GROWN[kind].PAPER)
    allowed = [p for p in allowed_params(kind) if p not in budget.SEARCHED]
    named = {}
    for key, value in model_overrides(options.set).items():
        if key in budget.SEARCHED:
            raise UserError(f"--budget searches the layers and filters: drop --set model.{key}")
        if key not in allowed:
            raise UserError(unknown_param(key, allowed, f"in the {kind} family of --budget"))
        fixed[key], named[key] = value, f"--set {key}"
    for flag, value in options.sizes().items():
        if value is None:
            continue
        param = SIZE_PARAMS[flag]
        if param not in fixed:
            raise UserError(f"--{flag.replace('_', '-')} does not apply to the {kind} family of --budget")
        fixed[param], named[param] = value, f"--{flag.replace('_', '-')}"
    check_limits(kind, fixed, named, "--budget")
    try:  # the family's smallest member, to refuse what no member can be (heads that do not divide d_model)
        build_model(kind, **budget.GROWN[kind].SMALLEST, **fixed)
    except ValueError as exc:
        raise UserError(f"--budget: {exc}") from None
    return kind, fixed


def budget_probe_seconds(kind: str, fixed: dict[str, Any], machine: sizing.Machine) -> float:
    """Seconds measuring the budget search's per-layer figures should take."""
    # Python-bound calls where the family states them (describing its layers to count FLOPs would cost as much);
    # else (Transformer-L) the arithmetic of its probe member's batches.
    if calls := budget.GROWN[kind].PROBE_CALLS:
        return calls * machine.call_seconds
    member = sizing.candidate(kind, {"layers": budget.TransformerL.PROBE_LAYERS, **fixed})
    return sizing.step_seconds(member, machine, sum(budget.TransformerL.PROBE_BATCHES), 1, 2.0)


def _calibrate(probes: list[probe.Probe], kind: str, machine: sizing.Machine, device: torch.device,
               console: Console, progress: Progress) -> probe.Correction:
    """The device correction, fitted from the probe's training steps (their time said on `progress`)."""
    seconds = sum(row_seconds(sizing.candidate(kind, p.params), machine, p.batch_size, p.microbatches, p.checkpoint)
                  for p in probes)
    progress.phase(f"probing {device}: {len(probes)} short training steps of small members", seconds, add=True)
    correction = probe.calibrate(probes, probe.CudaMeter(device) if device.type == "cuda" else probe.AccountingMeter())
    console.print(correction.describe(), highlight=False)
    return correction


# A budget row is measured here only when its step is expected within this many seconds, its member has at
# most this many pipeline layers, and it fits. Deep members of tiny layers run far slower than the estimate's
# arithmetic says: 10,002 such layers, estimated at 29 s, ran for over 10 minutes, and 92 of them (d_model
# 32, 2 stages) took 40 s against 5 s estimated, while 36 took 14 s against 7 s.
MEASURE_BELOW_S = 60.0
MEASURE_LAYERS = 64


def measured_row(row: budget.BudgetRow, kind: str, family: budget.TransformerL | budget.AmoebaNetD, batch: int,
                 options: ProfileOptions, machine: sizing.Machine, progress: Progress) -> budget.BudgetRow:
    """`row` with its fullest device measured by one step of the member it names, where that runs here soon."""
    params = family.member(row.model)
    cand = sizing.candidate(kind, params)
    seconds = row_seconds(cand, machine, batch, row.microbatches, row.checkpoint)
    have = float(mm.available_bytes("cpu")) * sizing.MEMORY_SHARE
    if seconds > MEASURE_BELOW_S or sum(row.balance) > MEASURE_LAYERS or row.device_peak_bytes > have \
            or torch.cuda.is_available():
        return row  # priced only: too slow or too large to run here (and on CUDA the allocator adds its own)
    progress.phase(f"measuring {row.scenario} ({kind} {row.model}, balance {row.balance})", seconds, add=True)
    spec = build_model(kind, **params)
    inputs, targets = example_batch(spec, batch, options.seed)
    # Deep members of small random layers drift into denormal values, which a CPU computes about ten times
    # slower (a 92-layer member: 27 s instead of 2 s); the bytes held do not depend on the values.
    torch.set_flush_denormal(True)
    try:
        stages = account.measure(spec, inputs, targets, row.balance, row.microbatches, row.schedule,
                                 row.checkpoint, options.optimizer, options.seed, "cpu", row.offload,
                                 len(row.balance) // row.partitions)
    finally:
        torch.set_flush_denormal(False)
    interrupts.check()
    return dataclasses.replace(row, measured_device_peak_bytes=max(s.total_bytes for s in stages))


def search(options: ProfileOptions, console: Console, progress: Progress) -> dict[str, Any]:
    """The largest model per scenario within the budget; the figures as the JSON file holds them."""
    limit = parse_size(options.budget or "", "--budget")
    device = _device(options.device)  # before anything is measured: a missing GPU is said at once
    kind, fixed = _family(options)
    batch = options.batch_size or families.of(kind).paper_batch
    refuse([options.examples_problem(kind, options.microbatches, batch)])
    machine = sizing.this_machine(torch.get_num_threads())
    m = options.microbatches
    base = scenarios.names(options.partitions, m, options.checkpoint)
    # The largest K again without remat, with stored inputs offloaded, and as V-Half: what each buys on K devices.
    k, remat = max(options.partitions), options.checkpoint if options.checkpoint != "never" else "except_last"
    rows_asked = [*base, (f"K={k} never", k, m, "never", options.schedule, "none"),
                  (f"K={k} offload", k, m, remat, options.schedule, "activations"),
                  (f"K={k} v-half", k, m, remat, "v-half", "none")]
    probe_s = budget_probe_seconds(kind, fixed, machine)
    search_s = budget.search_calls(kind, rows_asked, options.schedule, options.virtual_stages) * machine.call_seconds
    progress.estimated = FIXED_S + probe_s + search_s
    # Said before any phase: the last line compares what it took with this and the rows measured, each said as it
    # starts with its own estimate (which rows fit is known only once searched).
    console.print(f"[bold]budget[/] · the largest {kind} model within {human_bytes(limit)} per device, for "
                  f"{len(rows_asked)} rows · estimate: about {human_seconds(progress.estimated)} to search (this "
                  f"machine: {flop_rate(machine.flops_per_s)} measured), then each row measured", highlight=False)
    progress.phase(f"measuring per-layer figures of small {kind} models", probe_s)
    family = budget.GROWN[kind](fixed, options.seed)
    correction = None
    # On a GPU the accounting misses the allocator and the libraries: a few probe steps measure that. On the CPU
    # the meter is the accounting itself, so the probe runs only when asked for (--device cpu), as a check.
    if device.type == "cuda" or options.device == "cpu":
        # The family's two smallest members fit the device correction.
        probes = probe.steps(family.members(), base, kind, options.schedule, options.optimizer, options.seed,
                             probe_room(device))
        correction = _calibrate(probes, kind, machine, device, console, progress)
    progress.phase(f"searching the largest model of each of {len(rows_asked)} rows", search_s)
    rows = budget.search(family, rows_asked, limit, batch, options.schedule, options.optimizer, options.offload,
                         correction, options.virtual_stages)
    rows = [None if r is None else measured_row(r, kind, family, batch, options, machine, progress)
            for r in rows]
    return {"correction": None if correction is None else correction.to_json(),
            "budget_bytes": limit, "family": family.title, "kind": kind, "fixed": fixed, "batch_size": batch,
            "microbatches": m, "schedule": options.schedule, "checkpoint": options.checkpoint,
            "optimizer": options.optimizer, "bytes_per_param": kept.bytes_per_parameter(options.optimizer),
            "method": "per-layer figures measured by saved-tensor accounting on small members, scaled" + (
                "" if family.measured else " (on the meta device, from shapes: the members do not fit this machine)"),
            "rows": [None if r is None else dataclasses.asdict(r) for r in rows],
            "scenarios": [s[0] for s in rows_asked], "paper": budget.PAPER_TABLE1[kind]}


def run(options: ProfileOptions) -> int:
    """Run `gpipe profile-memory`: print the figures, return an exit code (UserError: bad options)."""
    with interrupts.remembered():
        return _run(options, output_console())


def _run(options: ProfileOptions, console: Console) -> int:
    if options.budget is None:  # the budget search checks its family's sizes in its own words
        kind = resolve(options.model, options.sizes(), options.set).kind  # a value refused is one line, no note first
        refuse([options.examples_problem(kind, options.microbatches, options.batch_size or 4 * options.microbatches)])
    for note in options.notes:  # first: sizing a large recipe takes a while
        console.print(f"[bold]note:[/] {note}", highlight=False)
    progress = Progress(lambda line: console.print(f"[dim]{line}[/]", highlight=False))
    if options.budget is not None:
        summary = search(options, console, progress)
        tables.show_budget(summary, console)
    else:
        summary = measure(options, console, progress)
        tables.show_measured(summary, console)
    console.print(f"[dim]{progress.took()}[/]")
    if options.json is not None:
        write_json(options.json, summary)
        console.print(f"[dim]figures written to {options.json}[/]")
    return 0
