"""The one-page PNG of `gpipe report`: six to ten panels, every run overlaid, named once in the page's legend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpipe_cli import plots
from gpipe_cli.errors import path_line
from gpipe_cli.pipeline import schedules
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
    """A curve of `key` for each run, in the run's colour (the page's legend names it)."""
    for i, run in enumerate(runs):
        steps, values = series(run).get(key, ([], []))
        if steps:
            # A marker keeps a curve of one or two points visible.
            fmt = style if "o" in style or len(steps) >= 3 else style + "o"
            ax.plot(steps, values, fmt, color=f"C{i}")
    _frame(ax, title, ylabel)


def _frame(ax: Any, title: str, ylabel: str) -> None:
    """A panel's title, axis labels (x: step) and grid."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _with_eval(key: str, title: str, ylabel: str) -> Draw:
    """A panel of a train curve (a line) with its eval counterpart (dots), on a log scale where one dwarfs the other."""
    def draw(ax: Any, runs: list[Run]) -> None:
        _lines(ax, runs, key, title, ylabel)
        for i, run in enumerate(runs):
            steps, values = series(run).get(f"eval_{key}", ([], []))
            ax.plot(steps, values, "o--", color=f"C{i}")  # the title says dots are eval
        values = [v for run in runs for k in (key, f"eval_{key}") for v in series(run).get(k, ([], []))[1]]
        if values and min(values) > 0 and max(values) > 20 * min(values):  # keep train and eval both readable
            ax.set_yscale("log")
            _plain_log_labels(ax)

    return draw


def _plain_log_labels(ax: Any) -> None:
    """Label a log axis with numbers as %g writes them, on the ticks matplotlib would label."""
    # Its own labels are TeX, which the page shows as typed: math text is off for run names holding a $.
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):  # type: ignore[misc]
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    ax.yaxis.set_major_formatter(Plain())
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))


def _perplexity(ax: Any, runs: list[Run]) -> None:
    """Train and eval perplexity, and the baseline a language model must get below: the held-out unigram's."""
    unigram = any("eval_unigram_perplexity" in series(run) for run in runs)
    _with_eval("perplexity", "perplexity (train: exp(loss), line; eval: dots"
               + (";\nheld-out unigram baseline: dotted" if unigram else "") + ")", "perplexity")(ax, runs)
    for i, run in enumerate(runs):
        steps, values = series(run).get("eval_unigram_perplexity", ([], []))
        if len(steps) == 1:  # a dotted line through one point draws nothing: the baseline is the same at every step
            ax.axhline(values[0], linestyle=":", color=f"C{i}")
        else:
            ax.plot(steps, values, ":", color=f"C{i}")


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


def _formula(schedule: str) -> str | None:
    """The schedule's bubble in closed form; None where it has none (it is simulated) or the name is unknown."""
    try:
        return schedules.get(schedule).bubble_formula
    except ValueError:  # a run of a schedule this version does not have
        return None


def bubble_title(runs: list[Run]) -> str:
    """The bubble panel's title: the formula where every run's schedule has that one, else each run's own theory."""
    formulas = {_formula(run.schedule) for run in runs}
    formula = formulas.pop() if len(formulas) == 1 else None
    theory = f"theory {formula}" if formula else ("theory of its schedule" if len(runs) == 1
                                                  else "theory of each run's own schedule")
    # The note on a line of its own: on one line the title ran past its panel.
    return f"bubble: measured (line), {theory} (dashed)\n{_no_warmup(runs)}"


def _bubble(ax: Any, runs: list[Run]) -> None:
    _lines(ax, runs, "bubble", bubble_title(runs), "share of step")
    for i, run in enumerate(runs):
        steps, values = series(run)["bubble_theory"]
        ax.plot(steps, values, "--", color=f"C{i}")
    ax.set_ylim(bottom=0)


def _apart(runs: list[Run]) -> list[str]:
    """What tells each run apart: its label but the words every run's label shares (the whole label for one run)."""
    words = [run.label.split(" ") for run in runs]
    common = set.intersection(*map(set, words)) if len(runs) > 1 else set()
    return [" ".join(w for w in label if w not in common) or run.label for label, run in zip(words, runs)]


def _breakdown(ax: Any, runs: list[Run]) -> None:
    many = len(runs) > 1
    xs: list[int] = []  # a run's stages side by side, a bar's gap between runs
    for i, run in enumerate(runs):
        xs += [len(xs) + i + s for s in range(run.stages)]
    bottoms = [0.0] * len(xs)
    for k, part in enumerate(PARTS):
        values = [v for run in runs for v in time_breakdown(run)[part]]
        ax.bar(xs, [v * 1e3 for v in values], bottom=bottoms, color=f"C{k}", label=part)
        bottoms = [b + v * 1e3 for b, v in zip(bottoms, values)]
    stages = [s for run in runs for s in range(run.stages)]
    if many:
        # Stage numbers under the bars, and under them once per run what tells it apart: one label per bar ran
        # into its neighbours; `_fit_ticks` rotates or drops what still does not fit.
        ax.set_xticks(xs, [str(s) for s in stages], minor=True)
        firsts = [x for x, s in zip(xs, stages) if s == 0]
        centers = [first + (run.stages - 1) / 2 for first, run in zip(firsts, runs)]
        ax.set_xticks(centers, _apart(runs))
        # Set on the axis, not the labels: a tick matplotlib adds later takes these, and not the labels' own.
        ax.tick_params(axis="x", which="minor", labelsize="x-small")
        ax.tick_params(axis="x", which="major", length=0, pad=12, labelsize="small")
    else:
        ax.set_xticks(xs, [f"stage {s}" for s in stages], fontsize="small")
    over = _no_warmup(runs, "mean over steps after warm-up", last_cut)
    if any(map(profiled_left_out, runs)):  # their time holds the profiler's
        over += ", profiled steps left out"
    stacked = "\neach run's stages side by side, under its name" if many else ""
    ax.set_title(f"step time per stage ({over})" + stacked + _last(runs))
    ax.set_ylabel("ms per step")
    ax.legend(fontsize="small", loc="upper center", ncols=len(PARTS))  # `_room` lifts the bars' axis under it


STYLES = ["-", "--", ":", "-."]  # the memory panel's line style of stage s: STYLES[s % 4]
MARKERS = ["o", "s", "^", "D"]  # and its marker, which tells stages apart where a point or two draw no line


def _memory(ax: Any, runs: list[Run]) -> None:
    for i, run in enumerate(runs):
        data = series(run)
        for s in range(run.stages):
            steps, values = data[f"mem_peak_bytes/stage{s}"]
            ax.plot(steps, [v / MIB for v in values], linestyle=STYLES[s % len(STYLES)],
                    marker=MARKERS[s % len(STYLES)] if len(steps) < 3 else None, color=f"C{i}")
    _frame(ax, "memory peak per stage (GPU: CUDA peak; CPU: activations)" + _last(runs), "MiB")
    # The colour is the run's (the page's legend); a legend of the styles says which stage a line is.
    most = max(run.stages for run in runs)
    styles = range(min(most, len(STYLES)))
    dots = any(len(series(run)[f"mem_peak_bytes/stage{s}"][0]) < 3 for run in runs for s in range(run.stages))
    handles = [plots.line(STYLES[j], "dimgray", MARKERS[j] if dots else None) for j in styles]
    labels = [f"stage{'s' if most > j + len(STYLES) else ''} "
              + ", ".join(str(s) for s in range(j, most, len(STYLES))) for j in styles]
    ax.legend(handles, labels, fontsize="small", loc="upper center", ncols=len(labels))


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
        out.append(("perplexity", _perplexity))
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


def _names(runs: list[Run]) -> list[str]:
    """Each run's label and folder (a label made unique by its folder already names it)."""
    names = [path_line(r.path.name) for r in runs]  # a name matplotlib can draw: one line, no undecodable byte
    return [r.label if r.label.endswith(f"({name})") else f"{r.label} ({name})" for r, name in zip(runs, names)]


def _short_title(runs: list[Run]) -> str:
    """The page's title where the runs' names do not fit on one line: their count and what they share."""
    common = [w for w in runs[0].label.split(" ") if all(w in r.label.split(" ") for r in runs[1:])]
    return f"gpipe report: {len(runs)} runs" + (f" of {' '.join(common)}" if common else "") + ", named below"


def _run_legend(fig: Any, runs: list[Run], top: float) -> Any:
    """One legend for the page, under its title: each run's colour, label and folder, in as few rows as fit."""
    handles = [plots.line("-", f"C{i}") for i in range(len(runs))]
    for ncols in range(len(runs), 0, -1):
        legend = fig.legend(handles, _names(runs), loc="upper center", bbox_to_anchor=(0.5, top), ncols=ncols,
                            fontsize="small", frameon=False)
        if plots.fits(fig, legend) or ncols == 1:
            return legend
        legend.remove()
    return None


def _whole_steps(ax: Any) -> None:
    """Widen a step axis around a lone step to the steps beside it: matplotlib ticked 5.68 to 6.32 around step 6."""
    if ax.get_xlabel() != "step":
        return
    low, high = ax.get_xlim()
    if high - low < 2:
        middle = round((low + high) / 2)
        ax.set_xlim(middle - 1, middle + 1)


def _fit_ticks(fig: Any, ax: Any) -> None:
    """Rotate the run labels under grouped bars that run into each other; drop stage numbers that would."""
    renderer = fig.canvas.get_renderer()
    for minor in (False, True):
        labels = [t for t in ax.get_xticklabels(minor=minor) if t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        if any(a.x1 + 2 > b.x0 for a, b in zip(boxes, boxes[1:])):
            for label in labels:
                if minor:  # too many bars to number each: the title says they are each run's stages
                    label.set_visible(False)
                else:
                    label.set_rotation(90)


def _room(fig: Any, ax: Any) -> None:
    """Raise the top of a panel's y axis until its legend, at the top, covers none of the data."""
    legend = ax.get_legend()
    if legend is None:
        return
    tops = [max(line.get_ydata(), default=None) for line in ax.get_lines()]
    tops += [patch.get_y() + patch.get_height() for patch in ax.patches]
    top = max((float(t) for t in tops if t is not None), default=None)
    if top is None:
        return
    bottom, high = ax.get_ylim()
    below = legend.get_window_extent(fig.canvas.get_renderer()).y0 - 4  # a few pixels between data and legend
    share = (below - ax.bbox.y0) / ax.bbox.height  # of the axis's height, what lies under the legend
    if share > 0.2 and top > bottom:  # a legend over most of its panel is left as it is
        ax.set_ylim(bottom, max(high, bottom + (top - bottom) / share))


def draw(runs: list[Run], path: Path) -> Path | None:
    """Write the report page as a PNG of WIDTH_PX x HEIGHT_PX; None when matplotlib cannot be imported."""
    plt = plots.pyplot()
    if plt is None:
        return None
    chosen = panels(runs)
    cols = min(len(chosen), 3)  # a fourth column narrows the panels until their titles run into each other
    rows = -(-len(chosen) // cols)
    fig, axes = plots.figure(plt, WIDTH_PX, HEIGHT_PX, rows, cols, "gpipe report: " + ", ".join(_names(runs)))
    title = fig._suptitle  # matplotlib's own attribute: the figure has no public getter of the artist
    if "\n" in title.get_text():  # the names run past one line: the legend under the title names each run
        title.set_text(_short_title(runs))
        plots.fit_width(fig, title)
    renderer = fig.canvas.get_renderer()
    below_title = (title.get_window_extent(renderer).y0 - 4) / fig.bbox.height
    legend = _run_legend(fig, runs, below_title)
    cells = [ax for row in axes for ax in row]
    for (_, panel), ax in zip(chosen, cells):
        panel(ax, runs)
        _whole_steps(ax)
    for ax in cells[len(chosen):]:
        ax.axis("off")
    # Twice: the first layout sizes the panels, which decides the ticks that fit; the second makes room for them.
    for _ in range(2):
        fig.tight_layout(rect=(0, 0, 1, legend.get_window_extent(renderer).y0 / fig.bbox.height))
        for ax in cells[:len(chosen)]:
            _fit_ticks(fig, ax)
    for ax in cells[:len(chosen)]:
        _room(fig, ax)
    return plots.save(plt, fig, path, laid_out=True)
