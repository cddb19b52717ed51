"""`gpipe bench`: measure K=1 and K ranks (or predict K devices), then print and save the figures."""

from __future__ import annotations

import contextlib
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from gpipe_cli import interrupts, plots, sizing
from gpipe_cli.bench import preview, setup, sweep, tables, trace
from gpipe_cli.bench.options import BenchOptions, parse_balance, run_name
from gpipe_cli.bench.setup import base_job, model_json, oversubscription
from gpipe_cli.console import output_console
from gpipe_cli.contention import contended
from gpipe_cli.errors import UserError
from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.estimate.measure import RunFigures, median
from gpipe_cli.estimate.subject import Subject, paced, resolve
from gpipe_cli.files import write_json, writing
from gpipe_cli.launch import LaunchOptions, warming
from gpipe_cli.limits import refuse
from gpipe_cli.models import families
from gpipe_cli.pipeline.config import sizes  # nearly equal parts, larger first
from gpipe_cli.pipeline.schedule import theoretical_bubble
from gpipe_cli.progress import Progress, took_line
from gpipe_cli.units import counted

STOPPED = 128 + signal.SIGINT


def summarise(options: BenchOptions, subject: Subject, k1: RunFigures, kk: RunFigures | None, costs: CostProfile,
              balance: list[int], balance_by: str, prediction: simulate.Prediction) -> dict[str, Any]:
    """Every figure of a single-configuration benchmark, as the JSON file holds them."""
    text = subject.build().task in ("translation", "lm")  # throughput is also counted in tokens
    k, m = kk.partitions if kk else prediction.partitions, options.microbatches
    over, hardware = oversubscription(k, options.threads)
    theory = theoretical_bubble(k, m, options.schedule, options.virtual_stages)
    ideal = k * (1 - theory)  # the schedule's own: K·M/(M+K-1) for GPipe, more for one that idles less
    measured = kk is not None
    ours = kk.samples_per_s if kk else prediction.samples_per_s
    normalized = ours / k1.samples_per_s if k1.samples_per_s else 0.0
    return {
        "model": model_json(subject), "partitions": k, "microbatches": m, "batch_size": options.batch,
        "schedule": options.schedule, "virtual_stages": options.virtual_stages, "checkpoint": options.checkpoint,
        "offload": options.offload, "balance": balance, "balance_by": balance_by,
        "measured": measured, "simulated": not measured, "measured_once": kk is k1,  # K=1 benchmarked: one run
        "samples_per_s": ours, "samples_per_s_k1": k1.samples_per_s,
        # Predicted tokens: the measured tokens per example at the predicted example rate.
        "tokens_per_s": (kk.units_per_s if kk else ours * k1.units_per_step / options.batch) if text else None,
        "tokens_per_s_k1": k1.units_per_s if text else None,
        "step_time_s": median(kk.step_times) if kk else prediction.step_time,
        "step_time_k1_s": median(k1.step_times),
        "step_times": kk.step_times if kk else [], "step_times_k1": k1.step_times,
        "normalized": normalized, "ideal": ideal, "efficiency": normalized / ideal if ideal else 0.0,
        "bubble": kk.bubble if kk else prediction.bubble,
        "bubble_theory": theory,
        "oversubscribed": over and measured, "hardware": hardware, "ranks": k, "threads": options.threads,
        "cpu_per_busy": {"k1": k1.cpu_per_busy, "k": kk.cpu_per_busy if kk else []},
        "load": {"k1": k1.load, "k": kk.load if kk is not None and kk is not k1 else {}},
        "contended": contended(k1.load) or bool(kk and contended(kk.load)),
        "steps": options.steps, "warmup": options.warmup,
        "memory_method": "CUDA allocator peak" if torch.cuda.is_available()
        else "saved-tensor accounting (stored activations)",
        "stages": [vars(s) for s in kk.stages] if kk else [],
        "stages_k1": [vars(s) for s in k1.stages],
        "prediction": {**prediction.to_json(), "label": "prediction", "bandwidth_gb_s": options.bandwidth,
                       "latency_us": options.latency_us,
                       # The simulator judged against the measurement of the same configuration.
                       "measured_over_predicted": ours / prediction.samples_per_s
                       if measured and prediction.samples_per_s else None},
        "layer_costs": asdict(costs),
    }


def _stopped(code: int) -> bool:
    """Whether ranks that exited with `code` were stopped by a signal (Ctrl-C, SIGTERM, SIGHUP), not failed."""
    return code in (STOPPED, *(128 + signum for signum in interrupts.TERMINATING))


def _launch(job: setup.Job, folder: Path, name: str, options: BenchOptions) -> dict[str, Any]:
    """Run `job`'s ranks: their figures, ours kept where only a --compare baseline failed."""
    try:
        return setup.launch_job(job, folder, name, options.threads)
    except setup.JobFailed as exc:
        if not (job.compare and exc.partial.get("runs")) or _stopped(exc.code):  # a Ctrl-C stops the whole command
            raise
        # Our figures are in; only a baseline failed (its rank printed why): report ours.
        return {**exc.partial, "compare": {}, "failed": f"a baseline failed (exit code {exc.code}); see above"}


def _single(options: BenchOptions, subject: Subject, folder: Path, progress: Progress,
            phases: dict[int, float]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure K=1 and K ranks (or predict K devices): the figures, and the K ranks' step for --trace."""
    spec = subject.build()
    k = options.stages
    then = ", then the engine against a plain loop" if options.measures_host_overhead else ""
    progress.phase(f"measuring K=1 ({len(spec.layers)} pipeline layers, per-layer costs and "
                   f"{counted(options.steps, 'step')}{then})", phases.get(1, 0.0))
    k_fields = {"trace": options.trace is not None, "compare": options.compare}
    k1_job = base_job(options, subject, 1, sizes(len(spec.layers), options.virtual_at(1)), profile_costs=True,
                      host_overhead=options.measures_host_overhead, **(k_fields if options.measures_once else {}))
    k1_raw = _launch(k1_job, folder, "k1", options)
    costs = CostProfile.from_json(k1_raw["costs"])
    k1 = RunFigures.from_json(k1_raw["runs"][0])
    # The explicit balance, else the prediction's cut of measured per-layer time into K x V chunks whose busiest
    # stage is least (`preview.check_cut` has refused a balance the model cannot take).
    explicit = parse_balance(options.balance, k * options.virtual_stages)
    link = simulate.Link.of(options.bandwidth, options.latency_us)
    prediction = simulate.predict(costs, k, options.batch, options.microbatches, options.schedule, options.checkpoint,
                                  link, median(k1.step_times), explicit, options.virtual_stages)
    balance, balance_by = prediction.balance, "measured time" if explicit is None else "explicit"
    kk: RunFigures | None = None
    raw: dict[str, Any] = {}
    if options.measures_once:
        raw, kk = k1_raw, k1
    elif not options.simulate:
        torch_too = "; then torch.distributed.pipelining's" if options.runs_torch else ""
        progress.phase(f"measuring {run_name(k, options.virtual_stages)} (balance {balance}{torch_too})",
                       phases.get(k, 0.0))
        raw = _launch(base_job(options, subject, k, balance, **k_fields), folder, f"k{k}", options)
        kk = RunFigures.from_json(raw["runs"][0])
    summary = summarise(options, subject, k1, kk, costs, balance, balance_by, prediction)
    if kk is not None and len(kk.stages) == k:
        replay = simulate.replayed(costs, prediction, [s.busy_s for s in kk.stages], options.schedule,
                                   options.checkpoint, link, options.virtual_stages)
        summary["prediction"]["from_stage_busy"] = {
            "samples_per_s": replay.samples_per_s, "bubble": replay.bubble,
            "measured_over_predicted": summary["samples_per_s"] / replay.samples_per_s}
    summary["host_overhead"] = host = k1_raw.get("host_overhead")  # None: measured at K=1 only
    loads = {"host_overhead": host["load"]} if host is not None else {}
    if "failed" in raw:
        summary["failed"] = raw["failed"]
    if kk is not None and options.compare:
        summary["peak_mem_bytes"] = kk.peak_bytes
        summary["stage_peak_bytes"] = [s.cuda_peak_bytes or s.activation_peak_bytes for s in kk.stages]
        summary["compare"] = {}
        for name, figures in raw.get("compare", {}).items():
            if "skipped" not in figures:  # else the installed torch has no counterpart, or refuses this K and M
                theirs, peak, idle = figures["samples_per_s"], figures["peak_mem_bytes"], figures["bubble"]
                figures = {**figures, "throughput_ratio": summary["samples_per_s"] / theirs if theirs else None,
                           "memory_ratio": kk.peak_bytes / peak if peak else None,
                           "bubble_ratio": summary["bubble"] / idle if idle else None}
                loads[name] = figures.get("load", {})
            summary["compare"][name] = figures
    summary["load"] |= loads
    summary["contended"] = summary["contended"] or any(contended(load) for load in loads.values())
    return summary, kk.events if kk is not None else []


@contextlib.contextmanager
def _bench_folder() -> Iterator[str]:
    """A temporary folder for the run's files, removed on the way out, even by a stop that came as it was made."""
    # A SIGTERM as the plan was shown landed inside TemporaryDirectory, after its mkdir: the folder stayed.
    with contextlib.ExitStack() as stack:
        with interrupts.deferred():
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpipe-bench-"))
        yield folder


@contextlib.contextmanager
def _temporary_root(folder: str) -> Iterator[None]:
    """Make `folder` the root of temporary files (the launcher's too), so removing it leaves nothing, Ctrl-C or not."""
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = previous


def results(options: BenchOptions, summary: dict[str, Any], events: list[dict[str, Any]], console: Console) -> None:
    """Print the figures and write the files asked for (--trace of `events`, the --sweep plot, --json)."""
    # Measuring is over: a Ctrl-C or SIGTERM from here on would stop the command between files it has
    # written and claim it wrote nothing, so they wait the moment it takes to finish.
    interrupts.finishing()
    # A file that cannot be written (a full disk) is told last, under the figures that took minutes to measure.
    failed: list[UserError] = []
    if options.trace is not None and summary["measured"]:  # the K ranks' step, and where it went
        title = (f"{summary['model']['name']}: K={summary['partitions']}, M={options.microbatches}, "
                 f"{options.schedule}, {options.checkpoint}")
        try:
            with writing(options.trace, "--trace"):
                chrome, png = trace.write(options.trace, events, title)
            summary["trace"] = {"chrome": str(chrome), "png": str(png) if png else None, "events": len(events)}
        except UserError as exc:
            failed.append(exc)
    if options.sweep:
        if (target := options.sweep_plot()) is not None:  # beside the --json file
            try:
                with writing(target, "--json (its --sweep plot)"):
                    png = sweep.plot(summary, target)
                console.print(f"[dim]plot written to {escape(str(png))}[/]" if png else
                              f"[yellow]no plot: {escape(plots.why_not())}[/]")
            except UserError as exc:
                failed.append(exc)
        sweep.show(summary, console)
    else:
        tables.show(summary, console)
    sized = summary["sized"]
    console.print(f"[dim]{took_line(sized['elapsed_s'], sized['estimate_s'])}[/]")
    if options.json is not None:
        write_json(options.json, summary)
        console.print(f"[dim]figures written to {options.json}[/]")
    if failed:
        raise failed[0]


def run(options: BenchOptions) -> int:
    """Run `gpipe bench` on options `bench.run` has validated; print the figures, return an exit code."""
    console = output_console()
    kind = resolve(options.model, options.sizes(), options.set).kind  # a value refused is one line, no note first
    refuse([options.examples_problem(kind, max(options.microbatch_values()), options.batch)])
    for note in options.notes:  # first: sizing a large recipe takes a while
        console.print(f"[bold]note:[/] {note}", highlight=False)
    progress = Progress(lambda line: console.print(f"[dim]{line}[/]", highlight=False))
    machine = sizing.this_machine(options.threads)
    chosen = preview.choose_subject(options, machine, progress.say)
    subject = chosen.subject
    if machine.kind == "cpu":  # its own layers at its micro-batch: small matrices reach less than the quick rate
        examples = max(sizing.ceil_div(options.batch, options.microbatches), families.of(subject.kind).least_examples)
        with sizing.torch_threads(options.threads):  # as a rank runs them
            machine = paced(machine, subject.build(), subject.kind, examples, options.seed, progress.say)
        chosen = replace(chosen, phases=preview.phase_seconds(sizing.candidate(subject.kind, subject.params),
                                                              machine, options))
    # What was spent choosing and pricing the model counts too: `took` is the whole command's time.
    chosen = replace(chosen, seconds=progress.elapsed() + sum(chosen.phases.values()))
    preview.show(chosen, options, machine, console)
    progress.estimated = chosen.seconds
    # Every run's ranks fork from one server (the same threads each): it imports torch once, not once a run.
    with _bench_folder() as tmp, _temporary_root(tmp), \
            warming(LaunchOptions(threads=options.threads), 1):
        try:
            events: list[dict[str, Any]] = []  # the K ranks' step, for --trace
            if options.sweep:
                summary = sweep.run(options, subject, Path(tmp), progress, chosen.phases)
            else:
                summary, events = _single(options, subject, Path(tmp), progress, chosen.phases)
        except setup.JobFailed as exc:
            if _stopped(exc.code):
                interrupts.say_stopped("gpipe bench")
            else:
                console.print(f"[red]gpipe bench: the benchmark ranks failed (exit code {exc.code}); see above[/]")
            return exc.code
        progress.done()
        summary["sized"] = {"note": chosen.note, "estimate_s": chosen.seconds, "elapsed_s": progress.elapsed()}
        results(options, summary, events, console)
    if summary.get("failed"):
        console.print(f"[red]gpipe bench: {summary['failed']}[/]")
        return 1
    return 0
