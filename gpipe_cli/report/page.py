"""The one-page PNG of `gpipe report`: six to ten panels, every run overlaid with its label in the legend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpipe_cli import plots
from gpipe_cli.records import PARTS
from gpipe_cli.report.runs import (
    Run,
    Starts,
    cut_steps,
    last_cut,
    profiled_left_out,
    segments,
    series,
    time_breakdown,
    warm_only,
)

WIDTH_PX, HEIGHT_PX = 1800, 1000
MIB = float(1 << 20)
Draw = Callable[[Any, list[Run]], None]  # draws one panel of the runs on a matplotlib axes


def _no_warmup(runs: list[Run], words: str = "warm-up steps left out",
               starts: Callable[[Run], Starts] = segments) -> str:
    """`words`, or what is true instead where some run has warm-up steps alone (kept: they are all it has)."""
    only = [warm_only(starts(run)) for run in runs]
    if not any(only):
        return words
    return "warm-up steps only: there are no others" if all(only) else "warm-up steps left out where there are others"


def _lines(ax: Any, runs: list[Run], key: str, title: str, ylabel: str, style: str = "-") -> None:
    """A curve of `key` for each run, with its legend."""
    for i, run in enumerate(runs):
        steps, values = series(run).get(key, ([], []))
        if steps:
            # A marker keeps a curve of one or two points visible.
            fmt = style if "o" in style or len(steps) >= 3 else style + "o"
            ax.plot(steps, values, fmt, color=f"C{i}", label=run.label)
    _frame(ax, title, ylabel)


def _frame(ax: Any, title: str, ylabel: str) -> None:
    """A panel's title, axis labels (x: step), grid and legend."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    _legend(ax)


def _legend(ax: Any) -> None:
    """The legend of the labelled curves (none, and no matplotlib warning, where nothing is labelled)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _with_eval(key: str, title: str, ylabel: str) -> Draw:
    """A panel of a train curve (a line) with its eval counterpart (dots), on a log scale where one dwarfs the other."""
    def draw(ax: Any, runs: list[Run]) -> None:
        _lines(ax, runs, key, title, ylabel)
        for i, run in enumerate(runs):
            steps, values = series(run).get(f"eval_{key}", ([], []))
            ax.plot(steps, values, "o--", color=f"C{i}", label=f"{run.label} eval" if steps else None)
        values = [v for run in runs for k in (key, f"eval_{key}") for v in series(run).get(k, ([], []))[1]]
        if values and min(values) > 0 and max(values) > 20 * min(values):  # keep train and eval both readable
            ax.set_yscale("log")
        _legend(ax)

    return draw


def _no_eval(ax: Any, runs: list[Run]) -> None:
    ax.set_title("eval: no evaluations recorded")
    ax.axis("off")


def _eval(metric: str, title: str) -> Draw:
    return lambda ax, runs: _lines(ax, runs, f"eval_{metric}", title, metric, "o-")


def _utilization(ax: Any, runs: list[Run]) -> None:
    # MFU where every run that has model FLOPs has a peak to compare them with, else the achieved rate.
    mfu = all("mfu" in series(run) for run in runs if "tflops" in series(run))
    if mfu:
        _lines(ax, runs, "mfu", f"MFU: model FLOPs / peak of all ranks ({_no_warmup(runs)})", "MFU")
    else:
        _lines(ax, runs, "tflops", f"achieved model TFLOP/s, all ranks ({_no_warmup(runs)})", "TFLOP/s")
    ax.set_ylim(bottom=0)


def _bubble(ax: Any, runs: list[Run]) -> None:
    # The note on a line of its own: on one line the title ran past its panel.
    _lines(ax, runs, "bubble", f"bubble: measured (line), theory (K-1)/(M+K-1) (dashed)\n{_no_warmup(runs)}",
           "share of step")
    for i, run in enumerate(runs):
        steps, values = series(run)["bubble_theory"]
        ax.plot(steps, values, "--", color=f"C{i}")  # unlabelled: the legend has the measured line's
    ax.set_ylim(bottom=0)


def _breakdown(ax: Any, runs: list[Run]) -> None:
    names = [f"{run.label} · {s}" if len(runs) > 1 else f"stage {s}" for run in runs for s in range(run.stages)]
    bottoms = [0.0] * len(names)
    for k, part in enumerate(PARTS):
        values = [v for run in runs for v in time_breakdown(run)[part]]
        ax.bar(range(len(names)), [v * 1e3 for v in values], bottom=bottoms, color=f"C{k}", label=part)
        bottoms = [b + v * 1e3 for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(names)), names, fontsize="small", rotation=30 if len(runs) > 1 else 0, ha="right"
                  if len(runs) > 1 else "center")
    over = _no_warmup(runs, "mean over steps after warm-up", last_cut)
    if any(map(profiled_left_out, runs)):  # their time holds the profiler's
        over += ", profiled steps left out"
    ax.set_title(f"step time per stage ({over})" + (": run · stage" if len(runs) > 1 else "") + _last(runs))
    ax.set_ylabel("ms per step")
    ax.legend(fontsize="small")


def _memory(ax: Any, runs: list[Run]) -> None:
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        data = series(run)
        for s in range(run.stages):
            steps, values = data[f"mem_peak_bytes/stage{s}"]
            style = styles[s % len(styles)] + ("o" if len(steps) < 3 else "")  # as _lines: a point stays visible
            ax.plot(steps, [v / MIB for v in values], style, color=f"C{i}", label=f"{run.label} stage {s}")
    _frame(ax, "memory peak per stage (GPU: CUDA peak; CPU: activations)" + _last(runs), "MiB")


def _last(runs: list[Run]) -> str:
    """Said in a per-stage panel's title when some run was resumed with another pipeline (its stages are not these)."""
    return "\nof a run resumed with another pipeline: its last one's steps" if any(map(cut_steps, runs)) else ""


def panels(runs: list[Run]) -> list[tuple[str, Draw]]:
    """The page's panels, by name, in order; task metrics and model FLOPs only where some run's records hold them."""
    has = set().union(*(series(run) for run in runs))
    out: list[tuple[str, Draw]] = [("loss", _with_eval("loss", "loss (train: line, eval: dots)", "loss"))]
    if "eval_accuracy" in has:
        out.append(("accuracy", _eval("accuracy", "eval accuracy")))
    if "eval_bleu" in has:
        out.append(("bleu", _eval("bleu", "eval BLEU")))
    if has & {"perplexity", "eval_perplexity"}:
        # Train perplexity is exp of the training loss, label smoothing included; eval's is without it.
        out.append(("perplexity", _with_eval("perplexity", "perplexity (train: exp(loss), line; eval: dots)",
                                             "perplexity")))
    if len(out) == 1:
        out.append(("eval", _no_eval))
    # The first step of each start (warm-up: one-time costs) is left out of throughput and bubble: a dip there
    # would stretch the axis over the steps that matter.
    out.append(("throughput", lambda ax, runs: _lines(ax, runs, "samples_per_s", f"throughput ({_no_warmup(runs)})",
                                                      "samples/s")))
    if "tflops" in has:
        out.append(("model flops", _utilization))
    out += [("bubble", _bubble), ("step time", _breakdown), ("memory", _memory)]
    return out


def draw(runs: list[Run], path: Path) -> Path | None:
    """Write the report page as a PNG of WIDTH_PX x HEIGHT_PX; None when matplotlib is not installed."""
    plt = plots.pyplot()
    if plt is None:
        return None
    # A label made unique by its folder already names it.
    title = "gpipe report: " + ", ".join(r.label if r.label.endswith(f"({r.path.name})") else
                                         f"{r.label} ({r.path.name})" for r in runs)
    chosen = panels(runs)
    cols = min(len(chosen), 3)  # a fourth column narrows the panels until their titles run into each other
    rows = -(-len(chosen) // cols)
    fig, axes = plots.figure(plt, WIDTH_PX, HEIGHT_PX, rows, cols, title)
    cells = [ax for row in axes for ax in row]
    for (_, panel), ax in zip(chosen, cells):
        panel(ax, runs)
    for ax in cells[len(chosen):]:
        ax.axis("off")
    return plots.save(plt, fig, path)
