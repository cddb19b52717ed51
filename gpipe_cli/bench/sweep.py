"""`gpipe bench --sweep`: the paper's Table 2, M ∈ {1, 4, 32} × K ∈ {2, 4, 8}, normalised to K=2, M=1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from gpipe_cli import plots
from gpipe_cli.bench import setup
from gpipe_cli.bench.options import SWEEP_MICROBATCHES, BenchOptions
from gpipe_cli.bench.setup import base_job, model_json, oversubscription, sweep_partitions, sweep_skipped
from gpipe_cli.console import figure_table
from gpipe_cli.contention import contended
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.estimate.measure import RunFigures
from gpipe_cli.estimate.subject import Subject
from gpipe_cli.models import families
from gpipe_cli.pipeline.schedule import theoretical_bubble
from gpipe_cli.progress import Progress
from gpipe_cli.units import figure


def run(options: BenchOptions, subject: Subject, folder: Path, progress: Progress,
        phases: dict[int, float]) -> dict[str, Any]:
    """Measure every (K, M) this machine hosts; the figures as the JSON file holds them."""
    layers = len(subject.build().layers)
    ks = sweep_partitions(options, layers)
    progress.phase(f"measuring per-layer costs ({layers} pipeline layers)", phases.get(1, 0.0))
    job = base_job(options, subject, 1, [layers], microbatches=[], profile_costs=True,
                   profile_chunks=max(SWEEP_MICROBATCHES))
    costs = CostProfile.from_json(setup.launch_job(job, folder, "costs", options.threads)["costs"])
    cells: list[dict[str, Any]] = []
    for k in ks:
        balance = costs.balance(k, options.checkpoint)
        progress.phase(f"measuring K={k} (balance {balance}), M = {', '.join(map(str, SWEEP_MICROBATCHES))}",
                       phases.get(k, 0.0))
        raw = setup.launch_job(base_job(options, subject, k, balance), folder, f"sweep-k{k}", options.threads)
        over, _ = oversubscription(k, options.threads)
        for run_json in raw["runs"]:
            figures = RunFigures.from_json(run_json)
            cells.append({"partitions": k, "microbatches": figures.microbatches, "balance": balance,
                          "samples_per_s": figures.samples_per_s, "bubble": figures.bubble,
                          "bubble_theory": theoretical_bubble(k, figures.microbatches, options.schedule),
                          "oversubscribed": over, "load": figures.load, "contended": contended(figures.load)})
    base = next((c for c in cells if c["microbatches"] == 1), None)
    family = families.FAMILIES.get(subject.kind)
    for c in cells:
        c["normalized"] = c["samples_per_s"] / base["samples_per_s"] if base and base["samples_per_s"] else None
        c["paper"] = family.paper_table2[c["microbatches"]].get(c["partitions"]) if family else None
    return {"model": model_json(subject), "sweep": cells, "batch_size": options.batch, "schedule": options.schedule,
            "checkpoint": options.checkpoint, "steps": options.steps, "warmup": options.warmup,
            "normalized_to": {"partitions": base["partitions"], "microbatches": 1} if base else None,
            "paper": {"table": "GPipe Table 2 (TPUs)", "model": family.paper_title if family else None},
            "skipped_partitions": list(skipped := sweep_skipped(options, layers)), "skipped_why": skipped,
            "oversubscribed": any(c["oversubscribed"] for c in cells),
            "contended": any(c["contended"] for c in cells)}


PLOT_PX = (1000, 600)


def plot_bars(summary: dict[str, Any]) -> tuple[list[str], dict[str, list[float | None]]]:
    """The plotted data: groups "M=m" and, per K, our normalised throughput and the paper's, as bars."""
    cells = summary["sweep"]
    ks = sorted({c["partitions"] for c in cells})
    ms = [m for m in SWEEP_MICROBATCHES if any(c["microbatches"] == m for c in cells)]
    bars: dict[str, list[float | None]] = {}
    for k in ks:
        found = {c["microbatches"]: c for c in cells if c["partitions"] == k}
        bars[f"K={k}"] = [found[m]["normalized"] if m in found else None for m in ms]
        if summary["paper"]["model"]:
            bars[f"K={k} paper"] = [found[m]["paper"] if m in found else None for m in ms]
    return [f"M={m}" for m in ms], bars


def plot(summary: dict[str, Any], path: Path) -> Path | None:
    """Draw the sweep as grouped bars, ours beside the paper's (hatched); None when matplotlib is missing."""
    plt = plots.pyplot()
    if plt is None:
        return None
    groups, bars = plot_bars(summary)
    paper = summary["paper"]["model"]
    fig, axes = plots.figure(plt, *PLOT_PX, 1, 1, f"Normalised throughput, {summary['model']['name']}"
                             + (f" (hatched: GPipe Table 2, {paper} on TPUs)" if paper else ""))
    plots.grouped_bars(axes[0][0], groups, bars, "normalised throughput",
                       hatched=[label for label in bars if label.endswith("paper")])
    return plots.save(plt, fig, path)


def show(summary: dict[str, Any], console: Console) -> None:
    """Print the sweep as the paper's table: rows M, columns K, ours with the paper's figure alongside."""
    cells = summary["sweep"]
    ks = sorted({c["partitions"] for c in cells})
    model = summary["model"]
    paper = summary["paper"]["model"]
    base = summary["normalized_to"]
    title = (f"Normalised throughput, {model['name']} (batch {summary['batch_size']}, {summary['schedule']}, "
             f"checkpoint {summary['checkpoint']})" + (f" · normalised to K={base['partitions']}, M=1" if base else ""))
    table = figure_table(title, ("M", *(f"K={k}" + (" (paper)" if paper else "") for k in ks)), left=("M",))
    for m in SWEEP_MICROBATCHES:
        row = [str(m)]
        for k in ks:
            c = next((c for c in cells if c["partitions"] == k and c["microbatches"] == m), None)
            if c is None:
                row.append("-")
                continue
            ours = figure(c["normalized"], ".2f")
            row.append(ours + (f" ({c['paper']:.2f})" if c["paper"] is not None else ""))
        table.add_row(*row)
    console.print(table)
    if paper:
        console.print(f"[dim]paper: GPipe Table 2, {paper} on TPUs; ours: this machine[/]")
    why = summary["skipped_why"]
    for reason in dict.fromkeys(why.values()):
        console.print(f"[yellow]K = {', '.join(str(k) for k, r in why.items() if r == reason)} skipped: {reason}[/]")
    if summary["contended"]:
        console.print("[bold yellow]CONTENDED:[/] other processes used the CPU while some cells were measured "
                      "(see `load` in the JSON); their speed figures are unreliable")
    if summary["oversubscribed"]:
        console.print("[bold yellow]OVERSUBSCRIBED:[/] some K share cores or GPUs; their speed figures mean little")
