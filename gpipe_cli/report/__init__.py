"""`gpipe report RUN_DIR...`: the figures of finished or running runs, as a table and a one-page PNG."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpipe_cli import plots
from gpipe_cli.console import output_console, print_table
from gpipe_cli.errors import UserError, path_line, shown_path
from gpipe_cli.files import check_not_input, check_output, check_picture, writing
from gpipe_cli.records import PARTS, PROFILED, profiled_words
from gpipe_cli.report import page
from gpipe_cli.report.runs import (
    HEADLINE,
    Run,
    cut_steps,
    eval_metric,
    last_cut,
    memory_peak,
    on_gpu,
    profiled_left_out,
    read_runs,
    segment_throughputs,
    segments,
    series,
    steps_words,
    throughput,
    time_breakdown,
    timed_mean,
    wait_share,
    warm_only,
)
from gpipe_cli.runs import CHECKPOINTS, PREFIX, SUPERSEDED, kept_by_a_run
from gpipe_cli.units import figure, human_bytes, number_range

# Said after a default place that cannot be written (a read-only run of someone else's, say).
ELSEWHERE = "; give --output FILE to write the page elsewhere"
# The columns that say whose a row is: a table split to fit the terminal repeats them in each part.
KEYS = ("run", "pipeline", "stage")


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...] = ("run",), caption: str | None = None) -> Table:
    """A table whose columns are right-aligned but `left`; a run's or start's label never wraps."""
    table = Table(title=title, header_style="bold", caption=caption)
    for name in columns:
        table.add_column(name, justify="left" if name in left else "right", no_wrap=name in ("run", "pipeline"))
    return table


def _over(runs: list[Run], after_warmup: str) -> str:
    """The steps a figure of each run's pipeline is the mean over, in words: those `after_warmup` of its last one."""
    # A run of warm-up steps alone (one step, say) keeps them: they are all it has.
    warm = [warm_only(last_cut(run)) for run in runs]
    words = "the training steps" if all(warm) else after_warmup
    for run, only in zip(runs, warm):
        notes = [f"{steps_words(steps)} only, its last pipeline"] if (steps := cut_steps(run)) else []
        if only and not all(warm):
            count = sum(map(len, last_cut(run)))
            notes.append(f"its warm-up step{'s' if count > 1 else ''}, all it has")
        if left := profiled_left_out(run):
            notes.append(profiled_words(left).removeprefix(", and "))
        words += f"; {run.label}: {', '.join(notes)}" if notes else ""
    return words


_HOLDS = {True: "a stage's CUDA allocator peak", False: "the most activations a stage stored at once"}


def _memory(runs: list[Run], column: str) -> tuple[str, str]:
    """The memory column's header, naming what its figures are, and the caption's words for them."""
    # A CPU run's figure is its stored activations alone (no allocator peak is read there); a GPU run's is the
    # whole allocator peak, weights, gradients and optimizer state too: read as one another, they mislead.
    gpu = [on_gpu(run) for run in runs]
    if all(gpu) or not any(gpu):
        cuda = "CUDA" if column.endswith("peak") else "CUDA peak"
        header = f"{column}\n({cuda if gpu[0] else 'activations'})"
        return header, _HOLDS[gpu[0]] + ("" if gpu[0] else " (a CPU run: no device peak is read)")
    named = {kind: ", ".join(run.label for run, g in zip(runs, gpu) if g == kind) for kind in (True, False)}
    return column, f"{_HOLDS[True]} on a GPU ({named[True]}), {_HOLDS[False]} on a CPU ({named[False]})"


def _part_of(run: Run) -> str:
    """For a course a resume set aside (checkpoints/superseded-...), which steps it holds and whose they follow."""
    first, last = run.train[0]["step"], run.train[-1]["step"]
    if first == 1:
        return ""
    if not run.path.name.startswith(SUPERSEDED) or run.path.parent.name != CHECKPOINTS:
        return ""
    return (f" (a course a resume set aside: steps {number_range(first, last)}, after the steps of "
            f"{run.path.parent.parent})")


def summary_table(runs: list[Run]) -> Table:
    """One row per run: last loss, best eval, largest stage peak, and its pipeline's throughput, bubble and wait."""
    # A run resumed with another pipeline: its row's K, M and schedule are its last pipeline's, and so are its
    # timing figures, as the row says (its loss, evals and memory are of every step).
    rates = [throughput(run) for run in runs]
    # The words of `gpipe train`'s summary, whose figure this is: one run says what its warm-up took.
    resumed = " and each resume" if any(len(last_cut(run)) > 1 for run in runs) else ""
    over = rates[0].over if len(runs) == 1 else _over(runs, f"the steps after the first of each run{resumed}, "
                                                            "which warm up")
    caption = (" · ".join(f"{r.label}: {path_line(r.path)}{_part_of(r)}" for r in runs)
               + f"\nsamples/s, bubble and wait: mean over {over}; each step weighted by its time")
    memory, holds = _memory(runs, "memory")
    if any(map(cut_steps, runs)):
        caption += f"\nmemory: the largest peak of any stage at any step, whatever pipeline ran it; {holds}"
    else:
        caption += f"\nmemory: {holds}"
    table = _table("gpipe report", ("run", "steps", "loss", "best eval", "samples/s", "bubble", "theory", "wait",
                                    memory), ("run", "best eval"), caption)
    for run, rate in zip(runs, rates):
        last = run.train[-1].get("loss")  # non-finite is written null: the last finite one was shown as the run's
        best = "-"
        metric = eval_metric(run)
        evals = [r for r in run.evals if r.get("loss") is not None]
        if evals:
            top = min(evals, key=lambda r: r["loss"])
            best = f"{top['loss']:.4g} @{top['step']}"
            if metric and top.get(metric) is not None:  # BLEU to a tenth, as train's summary gives it
                best += f", {HEADLINE[metric]} {top[metric]:{'.1f' if metric == 'bleu' else '.3g'}}"
        done = run.train[-1]["step"]
        steps = f"{done} of {run.planned}" if run.planned is not None and run.planned > done else str(done)
        if skipped := sum(r.get("skipped") is True for r in run.train):  # its loss may be a skipped step's
            steps += f" ({skipped} skipped)"
        if cut_steps(run):
            starts, cut = segments(run), last_cut(run)
            since, before = cut[0][0], starts[len(starts) - len(cut) - 1][0]
            # An older version's start, its M and schedule unrecorded, may have run the same pipeline.
            unknown = run.unrecorded(before) and run.stages == len(before["time_s"]["compute"])
            steps += f" ({'M and schedule unrecorded before' if unknown else 'pipeline changed at'} {since['step']})"
        table.add_row(run.label, steps, "nan" if last is None else figure(last, ".4f"), best,
                      figure(rate.samples_per_s, ".1f"), figure(timed_mean(run, "bubble"), ".3f"),
                      figure(timed_mean(run, "bubble_theory"), ".3f"), figure(wait_share(run), ".0%"),
                      "-" if (peak := memory_peak(run)) is None else human_bytes(int(peak)))
    return table


def stage_table(runs: list[Run]) -> Table:
    """One row per run and stage: mean milliseconds per step of each part, and the memory peak."""
    # A stage of another pipeline holds other layers: its figures are never averaged with this one's.
    memory, holds = _memory(runs, "memory peak")
    table = _table(f"per stage (mean over {_over(runs, 'the steps after warm-up')})",
                   ("run", "stage", *(f"{part} ms" for part in PARTS), memory), caption=f"memory peak: {holds}")
    for run in runs:
        parts, data = time_breakdown(run), series(run)
        for s in range(run.stages):
            peak = max(data[f"mem_peak_bytes/stage{s}"][1], default=None)  # "-": no record holds one
            table.add_row(run.label, str(s), *(f"{parts[part][s] * 1e3:.1f}" for part in PARTS),
                          "-" if peak is None else human_bytes(int(peak)))
    return table


def resume_table(runs: list[Run]) -> Table | None:
    """For resumed runs, one row per start: its steps and throughput as that start's `gpipe train` summary gave them."""
    resumed = [(run, parts) for run in runs if len(parts := segment_throughputs(run)) > 1]
    if not resumed:
        return None
    # The run's label is its last pipeline's: beside an earlier start it would read as that start's, so one
    # resumed run has no run column, and several name theirs on their first row only.
    named = len(resumed) > 1
    cut = {run.path: _forks(run.path) for run, _ in resumed}
    table = _table("per start of a resumed run (as its gpipe train summary gave it)",
                   ("run", "pipeline", "steps", "samples/s", "warm-up s")[0 if named else 1:], ("run", "pipeline"),
                   caption="samples/s: mean over the start's steps after its first, which warms up"
                   + (", and not its profiled steps" if any(r.get(PROFILED) is True for run, _ in resumed
                                                            for r in run.train) else "")
                   + ("; a start whose later steps a resume set aside (+): over its steps kept, not as its summary "
                      "gave it" if any(cut.values()) else ""))
    for run, parts in resumed:
        for i, (records, rate) in enumerate(zip(segments(run), parts)):
            later = i < len(parts) - 1 and records[-1]["step"] in cut[run.path]
            cells = [run.pipeline(records[0]), rate.steps + (" +" if later else ""), figure(rate.samples_per_s, ".1f"),
                     figure(rate.warmup_s, ".2f")]
            table.add_row(*([run.label if i == 0 else ""] if named else []), *cells,
                          end_section=named and i == len(parts) - 1)
    return table


def _forks(run_dir: Path) -> set[int]:
    """The steps its resumes from an earlier checkpoint went on from (setting aside the steps after)."""
    from gpipe_cli.train.existing import fork_of  # only here: it reads recipes

    aside = (run_dir / CHECKPOINTS).glob(f"{SUPERSEDED}*/{PREFIX}*")
    return {step for checkpoint in aside if (step := fork_of(checkpoint)) is not None}


def _console(tables: list[Table]) -> Console:
    """The terminal's console; elsewhere (a file, a pipe) one wide enough for the widest table, no cell cut."""
    console = output_console()
    if console.is_terminal:
        return console
    widest = max(console.measure(t, options=console.options.update_width(1 << 16)).maximum for t in tables)
    return output_console(widest)


def _default_page(paths: list[Path]) -> Path:
    """Where the page goes unless --output says: in the one run given, else here."""
    if len(paths) != 1:
        return Path("report.png")
    # A course a resume set aside lies in its run's checkpoints/, which training prunes: its page goes in the run.
    kept = kept_by_a_run(paths[0] / "report.png")
    return kept[0] / f"report-{paths[0].name}.png" if kept is not None else paths[0] / "report.png"


def report(paths: list[Path], output: Path | None = None) -> int:
    """Print the tables of the runs and write the page (PNG, PDF or SVG); 1 without matplotlib (tables still shown)."""
    paths = list({path.resolve(): path for path in paths}.values())  # a run given twice is one run
    # A mistake in the argument: one line, before anything is read.
    check_not_input(output, "--output", [(path / name, f"a run's {name}") for path in paths
                                         for name in ("metrics.jsonl", "recipe.yaml")],
                    "name another file, e.g. report.png")
    check_output(output, "--output", "report.png")
    if output is not None and output.suffix.lower().lstrip(".") not in plots.FORMATS:  # before a run is read
        raise UserError(f"--output: the page is written as PNG, PDF or SVG: name a file ending in .png, .pdf or .svg "
                        f"(got {shown_path(str(output))})")
    target = output or _default_page(paths)
    if output is None:  # a page by default where a file of the user's lies (one named with --output is theirs)
        check_picture(target, "gpipe report would write its page to", "name another file with --output")
    runs = read_runs(paths)
    tables = [table for table in (summary_table(runs), resume_table(runs), stage_table(runs)) if table is not None]
    console = _console(tables)
    for table in tables:
        print_table(console, table, KEYS)
    if plots.pyplot() is None:
        print(f"gpipe report: {plots.why_not()}; no page written", file=sys.stderr)
        return 1
    # The default place may be in a read-only run: the tables are shown, and the line says what to do.
    flag, hint = ("--output", "") if output is not None else ("", ELSEWHERE)
    check_output(target, flag, "report.png", hint)
    with writing(target, flag, hint):  # a disk can fill, or a folder change, after the check; never half a page
        page.draw(runs, target)
    console.print(f"wrote {path_line(target)}", soft_wrap=True, markup=False)  # a path stays one line, ready to copy
    return 0
