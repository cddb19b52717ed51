"""Where step records go: `metrics.jsonl` (one strict JSON object per line) and the terminal."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from gpipe_cli.console import fit, redraws, say
from gpipe_cli.errors import UserError, path_line
from gpipe_cli.files import space_left
from gpipe_cli.pipeline import stopping
from gpipe_cli.pipeline.failure import ANNOUNCED
from gpipe_cli.pipeline.stats import PARTS
from gpipe_cli.progress import StepMean, eta_text, note
from gpipe_cli.train.sinks import Sinks
from gpipe_cli.train.summary import eval_figures
from gpipe_cli.units import figure, flop_rate, human_bytes, share


def finite_json(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record with every NaN or infinity replaced by null, and a `nonfinite` list naming those keys."""
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
            return None  # strict JSON has no NaN; null keeps a column numeric for readers such as pandas
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, key) for v in value]
        return value

    out = clean(record, "")
    if bad:
        out["nonfinite"] = sorted(set(bad))
    return out


class RecordWriteError(UserError):
    """metrics.jsonl could not take a record; its earlier records are whole and the run stops."""

    exit_code = ANNOUNCED  # told in one line by rank 0: the launcher adds nothing


class MetricsFile:
    """Appends records to metrics.jsonl, each a whole line of strict JSON written at once, then to the other sinks."""

    def __init__(self, path: Path, sinks: Sinks | None = None) -> None:
        self.path, self.sinks = path, sinks
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (non-finite numbers as null, named in its `nonfinite` list), or RecordWriteError."""
        clean = finite_json(record)
        line = (json.dumps(clean, separators=(",", ":"), allow_nan=False) + "\n").encode()
        opened = os.fstat(self._fd)
        if not self._in_place(opened):  # its folder moved or removed: the run's other files would go elsewhere
            raise RecordWriteError(self._gone(record))
        end = opened.st_size
        try:
            done = 0
            while done < len(line):  # a full disk may take part of a line, then refuse the rest
                done += os.write(self._fd, line[done:])
        except OSError as exc:
            with contextlib.suppress(OSError):  # a half-written record would end the file in a broken line
                os.ftruncate(self._fd, end)
            raise RecordWriteError(self._failure(exc, record)) from None
        if self.sinks is not None:
            self.sinks.write(clean)

    def _failure(self, exc: OSError, record: Mapping[str, Any]) -> str:
        """One line: what failed, the space left, and how the run goes on."""
        from gpipe_cli.train.existing import way_on

        what = f"{errno.errorcode.get(exc.errno or 0, 'error')}: {exc.strerror or exc}"
        run_dir = self.path.parent
        return (f"cannot write {self.path.name} at step {record['step']} ({what}); {space_left(run_dir)}; "
                f"its earlier records are whole; once it can be written, {way_on(run_dir)}")

    def _in_place(self, opened: os.stat_result) -> bool:
        """Whether the file written is still the one at its path."""
        try:
            found = os.stat(self.path)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino)

    def _gone(self, record: Mapping[str, Any]) -> str:
        """One line: the run's folder moved or removed as it trained, and where its records went, if known."""
        from gpipe_cli.train.existing import way_on

        run_dir = self.path.parent
        try:  # Linux names the file an open descriptor writes, wherever it went
            now = os.readlink(f"/proc/self/fd/{self._fd}")
        except OSError:
            now = ""
        moved = Path(now).parent if now.startswith("/") and not now.endswith(" (deleted)") else None
        where = f"its records are in {path_line(moved)}; {way_on(moved)}" if moved else \
            "its records and checkpoints went with it"
        return (f"the run directory {path_line(run_dir)} was moved or removed while the run trained (found at step "
                f"{record['step']}); the run stops, so that nothing is written to two places: {where}")

    def close(self) -> None:
        """Close the file and the sinks."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.sinks is not None:
            self.sinks.close()


def utilization(record: Mapping[str, Any]) -> str:
    """The step's achieved model TFLOP/s and MFU ('' when the record has neither)."""
    if "tflops" not in record:
        return ""
    return flop_rate(record["tflops"] * 1e12) + (f" (MFU {share(record['mfu'])})" if "mfu" in record else "")


def stage_shares(record: Mapping[str, Any], stage: int) -> dict[str, float]:
    """Each part's share of the step time on one stage."""
    step = record["step_time_s"]
    return {part: record["time_s"][part][stage] / step if step > 0 else 0.0 for part in PARTS}


Counted = tuple[int, list[int]]  # the last step that counted its stored activations, and its figures


def counted_activations(record: Mapping[str, Any], last: Counted | None) -> Counted | None:
    """The newest stored-activation figures: this record's if it counted them, else the last ones."""
    return (record["step"], record["activation_peak_bytes"]) if "activation_peak_bytes" in record else last


def stage_memory(record: Mapping[str, Any], stage: int, counted: Counted | None = None) -> str:
    """One stage's memory, each figure named: stored activations (as last counted), process RSS peak, CUDA peak."""
    counted = counted_activations(record, counted)
    activations = "-" if counted is None else \
        human_bytes(counted[1][stage]) + ("" if counted[0] == record["step"] else f" (step {counted[0]})")
    text = f"activations {activations}, RSS peak {human_bytes(record['rss_peak_bytes'][stage])}"
    if "cuda_peak_bytes" in record:
        text += f", CUDA peak {human_bytes(record['cuda_peak_bytes'][stage])}"
    return text


def eval_line(record: Mapping[str, Any], total: int) -> str:
    """An eval record as one line."""
    return f"eval  step {record['step']}/{total} | {eval_figures(record)}"


def train_lines(record: Mapping[str, Any], total: int, counted: Counted | None = None,
                eta: float | None = None) -> list[str]:
    """A train record as lines: the step (with `eta`, the run's seconds left, when known), then one per stage."""
    lines = [f"step {record['step']}/{total} | epoch {record['epoch']} | loss {figure(record['loss'], '.4f')} | "
             f"lr {record['lr']:.3g} | {record['samples_per_s']:.1f} samples/s"
             + (f", {record['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in record else "") + " | "
             + (f"{utilization(record)} | " if "tflops" in record else "")
             + f"{record['step_time_s'] * 1e3:.0f} ms/step | "
             f"bubble {record['bubble']:.3f} (theory {record['bubble_theory']:.3f})"
             + (" | warm-up step (one-time costs)" if record.get("warmup") is True else "")
             + (" | profiled step (the profiler's work in it)" if record.get("profiled") is True else "")
             + (f" | {eta_text(eta)}" if eta is not None and record["step"] < total else "")]
    for s in range(len(record["rss_peak_bytes"])):
        shares = " | ".join(f"{part} {share:.0%}" for part, share in stage_shares(record, s).items())
        lines.append(f"  stage {s}: {shares} | {stage_memory(record, s, counted)}")
    return lines


class StepView:
    """A train record as the live view shows it, laid out for the width it is given."""

    def __init__(self, record: Mapping[str, Any], skipped: int, counted: Counted | None) -> None:
        self.record, self.skipped, self.counted = record, skipped, counted

    def figures(self) -> list[Text]:
        """Each figure with its label, one item that is never split."""
        r = self.record
        items = [("loss", figure(r["loss"], ".4f")), ("lr", f"{r['lr']:.3g}"),
                 ("grad norm", figure(r["grad_norm"], ".3g")),
                 ("skipped", str(self.skipped)), ("step", f"{r['step_time_s'] * 1e3:.0f} ms"),
                 ("samples/s", f"{r['samples_per_s']:.1f}")]
        if "tokens_per_s" in r:
            items.append(("tokens/s", f"{r['tokens_per_s']:.0f}"))
        items.append(("bubble", f"{r['bubble']:.3f} (theory {r['bubble_theory']:.3f})"))
        if "tflops" in r:
            items.append(("model", utilization(r)))
        return [Text.assemble((label, "dim"), " ", value, no_wrap=True) for label, value in items]

    def tables(self, time: bool = True, memory: bool = True, stacked: bool = False) -> Table:
        """Per stage: each part's share of the step time and/or its memory (`stacked`: headers a word a line)."""
        r = self.record
        table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold")
        table.add_column("stage", justify="right", no_wrap=True)
        if time:
            for part in PARTS:
                table.add_column("optim" if part == "optimizer" else part, justify="right", no_wrap=True)
        cuda = "cuda_peak_bytes" in r
        counted = counted_activations(r, self.counted)
        if memory:
            # The step the activations were counted at goes in the header: the cells keep to one figure each.
            table.add_column("activations" + (f"\n(step {counted[0]})" if counted else ""), justify="right",
                             no_wrap=True)
            table.add_column("RSS\npeak" if stacked else "RSS peak", justify="right", no_wrap=True)
            if cuda:
                table.add_column("CUDA\npeak" if stacked else "CUDA peak", justify="right", no_wrap=True)
        for s in range(len(r["rss_peak_bytes"])):
            cells = [f"{v:.0%}" for v in stage_shares(r, s).values()] if time else []
            if memory:
                cells += [human_bytes(counted[1][s]) if counted else "-", human_bytes(r["rss_peak_bytes"][s])]
                if cuda:
                    cells.append(human_bytes(r["cuda_peak_bytes"][s]))
            table.add_row(str(s), *cells)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        items = self.figures()
        for per_row in (len(items), 4, 2, 1):  # the fewest rows the width holds, in whole figures
            grid = Table.grid(padding=(0, 3))
            for row in range(0, len(items), per_row):
                grid.add_row(*items[row:row + per_row])
            if per_row == 1 or _width(console, options, grid) <= options.max_width:
                yield grid
                break
        whole = self.tables()
        if _width(console, options, whole) <= options.max_width:
            yield whole
        else:  # too narrow for one row per stage: the time shares, then the memory
            yield self.tables(memory=False)
            memory = self.tables(time=False)
            if _width(console, options, memory) > options.max_width:
                memory = self.tables(time=False, stacked=True)
            yield memory


def _width(console: Console, options: ConsoleOptions, renderable: RenderableType) -> int:
    """The columns `renderable` takes unwrapped (rich caps a measurement at the width it is given)."""
    return Measurement.get(console, options.update_width(10_000), renderable).maximum


class FittedProgress(Progress):
    """A progress line that drops its bar, then its title, where the width would cut a count or a time."""

    def get_renderable(self) -> RenderableType:
        return _FittedLine(self)


class _FittedLine:
    """The line of a FittedProgress's one task, laid out for the width it is given."""

    SHORTEST_BAR = 10  # a shorter bar says little, and takes the room of a time

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = [c for c in self.progress.columns if isinstance(c, ProgressColumn)]
        no_bar = [c for c in columns if not isinstance(c, BarColumn)]
        task = self.progress.tasks[0]
        for kept in (columns, no_bar, no_bar[1:]):  # the last is the counts and times alone, whatever the width
            cells = [c(task) for c in kept]
            need = sum(self.SHORTEST_BAR if isinstance(c, BarColumn) else _width(console, options, cell)
                       for c, cell in zip(kept, cells)) + len(kept) - 1
            if need <= options.max_width:
                break
        table = Table.grid(*(c.get_table_column().copy() for c in kept), padding=(0, 1))
        table.add_row(*cells)
        yield table


class TerminalView:
    """The terminal view of a run (rank 0)."""

    def __init__(self, title: str, plain: bool | None = None, started: float | None = None) -> None:
        self.stream: TextIO = sys.stdout
        self.plain = (not redraws(self.stream)) if plain is None else plain
        self.total, self.title = 0, title
        self.started = time.time() if started is None else started
        # A redrawn view must fit the terminal it is on: an exported COLUMNS wider than it stacked a copy of the bar
        # per redraw, and kept a resized window's size from rich.
        dropped = () if self.plain else ("COLUMNS", "LINES")
        self._console = Console(file=self.stream, highlight=False,
                                _environ={k: v for k, v in os.environ.items() if k not in dropped})
        self._live: Live | None = None
        self._cursor_back: Callable[[], None] = lambda: None
        self._last_train: Mapping[str, Any] | None = None
        self._counted: Counted | None = None
        self.skipped = 0
        self._steady = StepMean()  # step seconds past each start's warm-up step: the run's ETA
        self._profiled = StepMean()  # those of profiled steps, which the ETA leaves out while it has others
        # The bar takes what the other columns leave; a narrow terminal drops it, then the title, never a time.
        self._progress = FittedProgress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=None),
                                        MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                                        TimeRemainingColumn(), console=self._console)
        self._task = self._progress.add_task(title, total=None)

    def note(self, text: str) -> None:
        """A preparation step, with the seconds since the command started (before training begins)."""
        self.message(note(self.started, text))

    def start(self, total: int, first_step: int = 0) -> None:
        """Begin showing the progress of steps `first_step + 1` to `total`."""
        self.total = total
        self.note(f"training {self.title}: steps {first_step + 1} to {total}")
        if self.plain:
            return
        self._progress.update(self._task, total=total, completed=first_step)
        self._live = Live(Group(self._progress), console=self._console, refresh_per_second=4, transient=False)
        self._live.start()
        # A rank that ends at once leaves the terminal's cursor hidden: given back raw, as no lock may be free then.
        self._cursor_back = stopping.on_abrupt_exit(self._show_cursor)

    def message(self, text: str) -> None:
        """A one-off line (checkpoint written, step skipped, ...), wrapped at spaces on a terminal."""
        if self._live is not None:
            console = self._live.console
            console.print(fit(text, console.width), markup=False, highlight=False, soft_wrap=True)
        else:
            say(text, self.stream)

    def show(self, record: Mapping[str, Any], log_every: int = 1) -> None:
        """Show a train or eval record; the run's final eval is left to the summary, which gives it once."""
        if record["kind"] == "eval":
            if record["step"] != self.total:
                self.message(eval_line(record, self.total))
        else:
            self._last_train = record
            self._counted = counted_activations(record, self._counted)
            self.skipped += bool(record.get("skipped"))
            if record.get("warmup") is not True:
                (self._profiled if record.get("profiled") is True else self._steady).add(record["step_time_s"])
            if self.plain and (record["step"] % log_every == 0 or record["step"] == self.total):
                eta = (self._steady if self._steady.count else self._profiled).eta(record["step"], self.total)
                for line in train_lines(record, self.total, self._counted, eta):
                    say(line, self.stream)  # fitted on a terminal (--plain, TERM=dumb), whole in a log
        if self._live is not None and self._last_train is not None:
            self._progress.update(self._task, completed=self._last_train["step"])
            self._live.update(self.frame())
            if self._last_train["step"] >= self.total and not self._live.console.is_terminal:
                self.stop()  # a file gets its one frame now, before the lines after training (it came after them)

    def frame(self) -> Group:
        """What the live view shows now: progress and the latest step's figures per stage (evals print above it)."""
        if self._last_train is None:
            return Group(self._progress)
        return Group(self._progress, StepView(self._last_train, self.skipped, self._counted))

    def _show_cursor(self) -> None:
        if self._console.is_terminal:
            os.write(self.stream.fileno(), b"\n\x1b[?25h")

    def stop(self) -> None:
        """Stop the live view (its last frame stays on the screen)."""
        if self._live is not None:
            self._cursor_back()
            self._live.stop()
            if not self._live.console.is_terminal:  # rich leaves a file's last frame without its line end
                self._live.console.line()
            self._live = None
