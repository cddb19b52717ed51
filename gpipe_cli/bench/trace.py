"""One step's timeline: a Chrome trace (Perfetto, chrome://tracing) and a Gantt chart like GPipe's Figure 2."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpipe_cli import plots
from gpipe_cli.files import atomic_write_text
from gpipe_cli.pipeline.actions import COMPUTE, SHORT, Kind  # not pipeline.schedule (torch): the CLI imports this

# Each action's category in the trace and its colour in the chart (its short name is the schedule's own: `SHORT`).
LABELS = {
    Kind.FWD: ("forward", "#4c9be8"),
    Kind.RECOMPUTE: ("recompute", "#f2a541"),
    Kind.BWD: ("backward", "#5cb85c"),
    Kind.BWD_INPUT: ("backward: input gradient", "#2e8b57"),
    Kind.BWD_WEIGHT: ("backward: weight gradient", "#b5651d"),
    Kind.SEND_FWD: ("send activation", "#555555"),
    Kind.RECV_FWD: ("wait for activation", "#d9d9d9"),
    Kind.SEND_BWD: ("send gradient", "#555555"),
    Kind.RECV_BWD: ("wait for gradient", "#d9d9d9"),
}


def paths(target: Path) -> tuple[Path, Path]:
    """Where the Chrome trace and the PNG go for `--trace FILE`."""
    if target.suffix.lower() == ".png":  # as every other suffix is read: T.PNG is the chart
        return target.with_suffix(".json"), target
    return target, target.with_suffix(".png") if target.suffix else Path(str(target) + ".png")


# Events are timed in seconds from each rank's start of the step (the ranks start together after a barrier); a
# receive lasts as long as it waited for its message.
def chrome_trace(events: Sequence[Mapping[str, Any]], title: str) -> dict[str, Any]:
    """The events as a Chrome trace object: one "X" event per action plus track names."""
    stages = sorted({int(e["stage"]) for e in events})
    out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": title}}]
    for s in stages:
        out += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}},
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}}]
    named = _names(events)
    for e in sorted(events, key=lambda e: (e["stage"], e["start"])):
        out.append({
            "name": named(e), "cat": LABELS[e["kind"]][0], "ph": "X", "pid": 0,
            "tid": int(e["stage"]), "ts": round(e["start"] * 1e6, 3),
            "dur": round(max(e["end"] - e["start"], 0.0) * 1e6, 3),
            "args": {"stage": e["stage"], "microbatch": e["microbatch"], "chunk": e.get("chunk", e["stage"]),
                     "action": e["kind"]},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _names(events: Sequence[Mapping[str, Any]]) -> Callable[[Mapping[str, Any]], str]:
    """An action's name, `F0`, with its chunk where its stage holds several: `F0/c2`."""
    stages = {int(e["stage"]) for e in events}
    chunked = {s for s in stages if len({e.get("chunk", s) for e in events if e["stage"] == s}) > 1}

    def name(e: Mapping[str, Any]) -> str:
        return f"{SHORT[e['kind']]}{e['microbatch']}" + (f"/c{e['chunk']}" if e["stage"] in chunked else "")
    return name


def write_gantt(path: Path, events: Sequence[Mapping[str, Any]], title: str) -> bool:
    """Draw the Gantt chart as a PNG; False when matplotlib cannot be imported."""
    plt = plots.pyplot()
    if plt is None:
        return False
    from matplotlib.patches import Patch

    stages = sorted({int(e["stage"]) for e in events})
    end = max((e["end"] for e in events), default=0.0) * 1e3
    fig, ax = plt.subplots(figsize=(14.0, 1.6 + 0.5 * len(stages)))
    named = _names(events)
    for e in events:
        row = len(stages) - 1 - stages.index(int(e["stage"]))  # stage 0 on top, as in the paper
        start, width = e["start"] * 1e3, (e["end"] - e["start"]) * 1e3
        compute = e["kind"] in COMPUTE
        height = 0.8 if compute else 0.3
        ax.broken_barh([(start, width)], (row - height / 2, height), facecolors=LABELS[e["kind"]][1],
                       edgecolors="white" if compute else "none", linewidth=0.5)
        if compute and width > end / 150:
            ax.text(start + width / 2, row, named(e), ha="center",
                    va="center", fontsize=5 if width < end / 60 else 6, color="white")
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}" for s in reversed(stages)])
    ax.set_xlabel("time in the step (ms)")
    ax.set_xlim(0, end * 1.01 if end else 1)
    ax.set_title(title, fontsize=9)
    legend = [Patch(color=colour, label=label) for label, colour in legend_entries(events)]
    fig.legend(handles=legend, fontsize=7, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    plots.write(plt, fig, path, 150)
    return True


def legend_entries(events: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(label, colour) for each kind of action the step holds: a schedule without a split backward shows no W."""
    drawn = {e["kind"] for e in events}
    return [(label, LABELS[kinds[0]][1]) for kinds, label in
            (((Kind.FWD,), "forward"), ((Kind.RECOMPUTE,), "recompute"), ((Kind.BWD,), "backward"),
             ((Kind.BWD_INPUT,), "backward: input gradient (B)"), ((Kind.BWD_WEIGHT,), "backward: weight gradient (W)"),
             ((Kind.RECV_FWD, Kind.RECV_BWD), "wait for a message"), ((Kind.SEND_FWD, Kind.SEND_BWD), "send"))
            if drawn.intersection(kinds)]


def write(target: Path, events: Sequence[Mapping[str, Any]], title: str) -> tuple[Path, Path | None]:
    """Write both files for `--trace FILE`; the PNG path is None when matplotlib is missing."""
    json_path, png_path = paths(target)
    atomic_write_text(json_path, json.dumps(chrome_trace(events, title)))
    try:
        drawn = write_gantt(png_path, events, title)
    except BaseException:  # the chart could not be written: nor is the trace, as the error line says
        json_path.unlink(missing_ok=True)
        raise
    return json_path, png_path if drawn else None
