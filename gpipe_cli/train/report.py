"""Where step records go: `metrics.jsonl` (one strict JSON object per line) and the terminal.

On a terminal the view is live (rich): a progress bar with ETA, loss, LR, throughput, the measured
bubble against theory, where each stage's step time goes, labelled memory per stage and the latest
eval. Elsewhere (CI, log files) or with --plain it prints the same as lines.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gpipe_cli.pipeline.stats import PARTS
from gpipe_cli.progress import eta_text, run_eta
from gpipe_cli.train.announce import note
from gpipe_cli.train.sinks import Sinks
from gpipe_cli.train.summary import eval_figures
from gpipe_cli.units import human_bytes

_PART_LABELS = {"compute": "compute", "wait": "wait (bubble)", "comm": "comm", "optimizer": "optimizer",
                "other": "other"}


def finite_json(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every NaN or infinity replaced by null, and a `nonfinite` list naming those keys.

    Strict JSON has no NaN; null keeps numeric columns numeric for readers such as pandas.
    """
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, key) for v in value]
        return value

    out = clean(record, "")
    if bad:
        out["nonfinite"] = sorted(set(bad))
    return out


class MetricsFile:
    """Appends records to metrics.jsonl; each record is one whole line of strict JSON, flushed at once.

    The same records then go to the recipe's other sinks (TensorBoard, W&B).
    """

    def __init__(self, path: Path, sinks: Sinks | None = None) -> None:
        self.path, self.sinks = path, sinks
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (non-finite numbers as null, named in its `nonfinite` list)."""
        clean = finite_json(record)
        self._file.write(json.dumps(clean, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()
        if self.sinks is not None:
            self.sinks.write(clean)

    def close(self) -> None:
        """Close the file and the sinks."""
        self._file.close()
        if self.sinks is not None:
            self.sinks.close()


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rate(record: dict[str, Any]) -> str:
    rate = f"{record['samples_per_s']:.1f} samples/s"
    if "tokens_per_s" in record:
        rate += f", {record['tokens_per_s']:.0f} tokens/s"
    return rate


def stage_shares(record: dict[str, Any], stage: int) -> dict[str, float]:
    """Each part's share of the step time on one stage."""
    step = record["step_time_s"]
    return {part: record["time_s"][part][stage] / step if step > 0 else 0.0 for part in PARTS}


Counted = tuple[int, list[int]]  # the last step that counted its stored activations, and its figures


def counted_activations(record: dict[str, Any], last: Counted | None) -> Counted | None:
    """The newest stored-activation figures: this record's if it counted them, else the last ones."""
    return (record["step"], record["activation_peak_bytes"]) if "activation_peak_bytes" in record else last


def _activations(record: dict[str, Any], stage: int, counted: Counted | None) -> str:
    if counted is None:
        return "-"
    step, values = counted
    return human_bytes(values[stage]) + ("" if step == record["step"] else f" (step {step})")


def stage_memory(record: dict[str, Any], stage: int, counted: Counted | None = None) -> str:
    """One stage's memory, each figure named: stored activations (as last counted), process RSS peak, CUDA peak."""
    text = (f"activations {_activations(record, stage, counted_activations(record, counted))}, "
            f"RSS peak {human_bytes(record['rss_peak_bytes'][stage])}")
    if "cuda_peak_bytes" in record:
        text += f", CUDA peak {human_bytes(record['cuda_peak_bytes'][stage])}"
    return text


def eval_line(record: dict[str, Any], total: int) -> str:
    """An eval record as one line."""
    return f"eval  step {record['step']}/{total} | {eval_figures(record)}"


def train_lines(record: dict[str, Any], total: int, counted: Counted | None = None,
                eta: float | None = None) -> list[str]:
    """A train record as lines: the step (with `eta`, the run's seconds left, when known), then one line per stage
    with its time and memory."""
    lines = [f"step {record['step']}/{total} | epoch {record['epoch']} | loss {_num(record['loss'], '.4f')} | "
             f"lr {record['lr']:.3g} | {_rate(record)} | {record['step_time_s'] * 1e3:.0f} ms/step | "
             f"bubble {record['bubble']:.3f} (theory {record['bubble_theory']:.3f})"
             + (" | warm-up step (one-time costs)" if record.get("warmup") is True else "")
             + (f" | {eta_text(eta)}" if eta is not None and record["step"] < total else "")]
    for s in range(len(record["rss_peak_bytes"])):
        shares = " | ".join(f"{part} {share:.0%}" for part, share in stage_shares(record, s).items())
        lines.append(f"  stage {s}: {shares} | {stage_memory(record, s, counted)}")
    return lines


class TerminalView:
    """The terminal view of a run (rank 0)."""

    def __init__(self, title: str, plain: bool | None = None, stream: TextIO | None = None,
                 started: float | None = None) -> None:
        self.stream = stream or sys.stdout
        self.plain = (not self.stream.isatty()) if plain is None else plain
        self.total, self.title = 0, title
        self.started = time.time() if started is None else started
        self._console = Console(file=self.stream, highlight=False)
        self._live: Live | None = None
        self._last_train: dict[str, Any] | None = None
        self._last_eval: dict[str, Any] | None = None
        self._counted: Counted | None = None
        self.skipped = 0
        self._steady: list[float] = []  # step seconds past each start's warm-up step: the run's ETA
        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self._console)
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

    def message(self, text: str) -> None:
        """A one-off line (checkpoint written, step skipped, ...)."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def show(self, record: dict[str, Any], log_every: int = 1) -> None:
        """Show a train or eval record."""
        if record["kind"] == "eval":
            self._last_eval = record
            self.message(eval_line(record, self.total))
        else:
            self._last_train = record
            self._counted = counted_activations(record, self._counted)
            self.skipped += bool(record.get("skipped"))
            if record.get("warmup") is not True:
                self._steady.append(record["step_time_s"])
            if self.plain and (record["step"] % log_every == 0 or record["step"] == self.total):
                eta = run_eta(self._steady, record["step"], self.total, warmup=0)
                for line in train_lines(record, self.total, self._counted, eta):
                    print(line, file=self.stream, flush=True)
        if self._live is not None and self._last_train is not None:
            self._progress.update(self._task, completed=self._last_train["step"])
            self._live.update(self.frame())

    def frame(self) -> Group:
        """What the live view shows now: progress, the latest step's figures per stage, the latest eval."""
        if self._last_train is None:
            return Group(self._progress)
        return Group(self._progress, self._table(self._last_train))

    def _table(self, record: dict[str, Any]) -> Group:
        head = Table(show_header=False, box=None, padding=(0, 2))
        head.add_row("loss", _num(record["loss"], ".4f"), "lr", f"{record['lr']:.3g}",
                     "grad norm", _num(record["grad_norm"], ".3g"), "skipped", str(self.skipped))
        head.add_row("speed", _rate(record), "step", f"{record['step_time_s'] * 1e3:.0f} ms",
                     "bubble", f"{record['bubble']:.3f} (theory {record['bubble_theory']:.3f})", "", "")
        stages = Table(box=None, padding=(0, 2), header_style="bold")
        cuda = "cuda_peak_bytes" in record
        for name in ("stage", *(_PART_LABELS[p] for p in PARTS), "activations", "RSS peak",
                     *(("CUDA peak",) if cuda else ())):
            stages.add_column(name, justify="right")
        for s in range(len(record["rss_peak_bytes"])):
            memory = [_activations(record, s, self._counted), human_bytes(record["rss_peak_bytes"][s])]
            if cuda:
                memory.append(human_bytes(record["cuda_peak_bytes"][s]))
            stages.add_row(str(s), *(f"{v:.0%}" for v in stage_shares(record, s).values()), *memory)
        parts: list[Any] = [head, stages]
        if self._last_eval is not None:
            parts.append(f"eval (step {self._last_eval['step']}): {eval_figures(self._last_eval)}")
        return Group(*parts)

    def stop(self) -> None:
        """Stop the live view (its last frame stays on the screen)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
