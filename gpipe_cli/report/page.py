"""The one-page PNG of `gpipe report`: six panels, every run overlaid with its label in the legend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpipe_cli import plots
from gpipe_cli.report.runs import PARTS, Run, eval_metric, series, time_breakdown

WIDTH_PX, HEIGHT_PX = 1800, 1000
MIB = float(1 << 20)


def _lines(ax: Any, runs: list[Run], key: str, title: str, ylabel: str, style: str = "-") -> None:
    for i, run in enumerate(runs):
        steps, values = series(run).get(key, ([], []))
        if steps:
            # A marker keeps a curve of one or two points visible.
            fmt = style if "o" in style or len(steps) >= 3 else style + "o"
            ax.plot(steps, values, fmt, color=f"C{i}", label=run.label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _losses(ax: Any, runs: list[Run]) -> None:
    _lines(ax, runs, "loss", "loss (train: line, eval: dots)", "loss")
    for i, run in enumerate(runs):
        steps, values = series(run)["eval_loss"]
        ax.plot(steps, values, "o--", color=f"C{i}", label=f"{run.label} eval" if steps else None)
    values = [v for run in runs for key in ("loss", "eval_loss") for v in series(run)[key][1]]
    if values and min(values) > 0 and max(values) > 20 * min(values):  # keep train and eval both readable
        ax.set_yscale("log")
    ax.legend(fontsize="small")


def _eval(ax: Any, runs: list[Run]) -> None:
    metrics = {m for r in runs if (m := eval_metric(r))}
    if not metrics:
        ax.set_title("eval: no evaluations recorded")
        ax.axis("off")
        return
    metric = sorted(metrics)[0]
    _lines(ax, runs, f"eval_{metric}", f"eval {metric}", metric, "o-")
    ax.legend(fontsize="small")


def _bubble(ax: Any, runs: list[Run]) -> None:
    _lines(ax, runs, "bubble", "bubble: measured (line) against theory (K-1)/(M+K-1) (dashed), no warm-up steps",
           "share of step")
    for i, run in enumerate(runs):
        steps, values = series(run)["bubble_theory"]
        ax.plot(steps, values, "--", color=f"C{i}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")


def _breakdown(ax: Any, runs: list[Run]) -> None:
    names, bottoms = [], []
    for run in runs:
        names += [f"{run.label} · {s}" if len(runs) > 1 else f"stage {s}" for s in range(run.stages)]
    bottoms = [0.0] * len(names)
    for k, part in enumerate(PARTS):
        values = [v for run in runs for v in time_breakdown(run)[part]]
        ax.bar(range(len(names)), [v * 1e3 for v in values], bottom=bottoms, color=f"C{k}", label=part)
        bottoms = [b + v * 1e3 for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(names)), names, fontsize="small", rotation=30 if len(runs) > 1 else 0, ha="right"
                  if len(runs) > 1 else "center")
    ax.set_title("step time per stage (mean over steps after warm-up)" + (": run · stage" if len(runs) > 1 else ""))
    ax.set_ylabel("ms per step")
    ax.legend(fontsize="small")


def _memory(ax: Any, runs: list[Run]) -> None:
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        data = series(run)
        for s in range(run.stages):
            steps, values = data[f"mem_peak_bytes/stage{s}"]
            ax.plot(steps, [v / MIB for v in values], styles[s % len(styles)], color=f"C{i}",
                    label=f"{run.label} stage {s}")
    ax.set_title("memory peak per stage (GPU: CUDA peak; CPU: activations)")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def draw(runs: list[Run], path: Path) -> Path | None:
    """Write the report page as a PNG of WIDTH_PX x HEIGHT_PX; None when matplotlib is not installed."""
    plt = plots.pyplot()
    if plt is None:
        return None
    title = "gpipe report: " + ", ".join(f"{r.label} ({r.path.name})" for r in runs)
    fig, axes = plots.figure(plt, WIDTH_PX, HEIGHT_PX, 2, 3, title)
    _losses(axes[0][0], runs)
    _eval(axes[0][1], runs)
    # The first step of each start (warm-up: one-time costs) is left out of throughput and bubble: a dip there
    # would stretch the axis over the steps that matter.
    _lines(axes[0][2], runs, "samples_per_s", "throughput (warm-up steps left out)", "samples/s")
    axes[0][2].legend(fontsize="small")
    _bubble(axes[1][0], runs)
    _breakdown(axes[1][1], runs)
    _memory(axes[1][2], runs)
    return plots.save(plt, fig, path)
