"""`gpipe report RUN_DIR...`: the figures of finished or running runs, as a table and a one-page PNG."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpipe_cli import plots
from gpipe_cli.report import page
from gpipe_cli.report.runs import PARTS, Run, eval_metric, read_runs, series, time_breakdown
from gpipe_cli.units import human_bytes

__all__ = ["default_output", "report", "stage_table", "summary_table"]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(runs: list[Run]) -> Table:
    """One row per run: last loss, best eval, mean throughput, mean bubble, wait share, largest stage peak."""
    table = Table(title="gpipe report", header_style="bold",
                  caption=" · ".join(f"{r.label}: {r.path}" for r in runs))
    for name in ("run", "steps", "loss", "best eval", "samples/s", "bubble", "theory", "wait", "memory"):
        # A run's label is what a reader looks up in the legend: it never wraps, other cells do.
        table.add_column(name, justify="left" if name in ("run", "best eval") else "right", no_wrap=name == "run")
    for run in runs:
        data = series(run)
        losses = data["loss"][1]
        best = "-"
        metric = eval_metric(run)
        evals = [r for r in run.evals if r.get("loss") is not None]
        if evals:
            top = min(evals, key=lambda r: r["loss"])
            best = f"{top['loss']:.4g} @{top['step']}"
            if metric and top.get(metric) is not None:
                best += f", {metric[:3]} {top[metric]:.3g}"
        parts = time_breakdown(run)
        total = sum(sum(v) for v in parts.values())
        wait = sum(parts["wait"]) / total if total else None
        peak = max((max(data[f"mem_peak_bytes/stage{s}"][1], default=0.0) for s in range(run.stages)), default=0.0)
        table.add_row(run.label, str(run.train[-1]["step"]), _fmt(losses[-1] if losses else None, ".4f"), best,
                      _fmt(_mean(data["samples_per_s"][1]), ".1f"), _fmt(_mean(data["bubble"][1]), ".3f"),
                      _fmt(_mean(data["bubble_theory"][1]), ".3f"), _fmt(wait, ".0%"), human_bytes(int(peak)))
    return table


def stage_table(runs: list[Run]) -> Table:
    """One row per run and stage: mean milliseconds per step of each part, and the memory peak."""
    table = Table(title="per stage (mean over steps)", header_style="bold")
    for name in ("run", "stage", *(f"{part} ms" for part in PARTS), "memory peak"):
        table.add_column(name, justify="left" if name == "run" else "right", no_wrap=name == "run")
    for run in runs:
        parts, data = time_breakdown(run), series(run)
        for s in range(run.stages):
            peak = max(data[f"mem_peak_bytes/stage{s}"][1], default=0.0)
            table.add_row(run.label, str(s), *(f"{parts[part][s] * 1e3:.1f}" for part in PARTS),
                          human_bytes(int(peak)))
    return table


def default_output(paths: list[Path]) -> Path:
    """RUN_DIR/report.png for one run, report.png here for several."""
    return paths[0] / "report.png" if len(paths) == 1 else Path("report.png")


def report(paths: list[Path], output: Path | None = None, console: Any = None) -> int:
    """Print the table of the runs and write the PNG page; 1 when matplotlib is missing (the table is shown)."""
    runs = read_runs(paths)
    console = console or Console()
    console.print(summary_table(runs))
    console.print(stage_table(runs))
    target = output or default_output(paths)
    written = page.draw(runs, target)
    if written is None:
        print(f"gpipe report: {plots.MISSING}; no PNG written", file=sys.stderr)
        return 1
    console.print(f"wrote {written}", soft_wrap=True)  # a path stays one line, ready to copy
    return 0
