"""Where step records go: `metrics.jsonl` (one JSON object per line) and the terminal.

On a terminal the view is live (rich): a progress bar with ETA, loss, LR, throughput, measured vs
theoretical bubble and memory per stage. Elsewhere (CI, log files) it prints plain lines.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from gpipe_cli.units import human_bytes


class MetricsFile:
    """Appends records to metrics.jsonl; each record is one whole line, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _line(record: dict[str, Any], total: int) -> str:
    if record["kind"] == "eval":
        extra = "".join(f" | {k} {record[k]:.4g}" for k in ("accuracy", "bleu", "perplexity") if k in record)
        return f"eval  step {record['step']}/{total} | loss {record['loss']:.4f}{extra}"
    mem = ", ".join(human_bytes(m) for m in record["mem_peak_bytes"])
    rate = f"{record['samples_per_s']:.1f} samples/s"
    if "tokens_per_s" in record:
        rate += f", {record['tokens_per_s']:.0f} tokens/s"
    return (f"step {record['step']}/{total} | epoch {record['epoch']} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.3g} | {rate} | bubble {record['bubble']:.3f} (theory "
            f"{record['bubble_theory']:.3f}) | mem {mem}")


class TerminalView:
    """The terminal view of a run."""

    def __init__(self, total: int, title: str, plain: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.plain = (not self.stream.isatty()) if plain is None else plain
        self.total, self.title = total, title
        self._console = Console(file=self.stream)
        self._live: Live | None = None
        self._last_eval: dict[str, Any] | None = None
        if not self.plain:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=self._console)
            self._task = self._progress.add_task(title, total=total)

    def start(self, first_step: int = 0) -> None:
        """Begin showing progress."""
        if self.plain:
            print(f"{self.title}: {self.total} steps", file=self.stream, flush=True)
            return
        self._progress.update(self._task, completed=first_step)
        self._live = Live(Group(self._progress), console=self._console, refresh_per_second=4, transient=False)
        self._live.start()

    def message(self, text: str) -> None:
        """A one-off line (checkpoint written, resumed, ...)."""
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def show(self, record: dict[str, Any], log_every: int = 1) -> None:
        """Show a train or eval record."""
        if record["kind"] == "eval":
            self._last_eval = record
            self.message(_line(record, self.total))
            return
        if self.plain:
            if record["step"] % log_every == 0 or record["step"] == self.total:
                print(_line(record, self.total), file=self.stream, flush=True)
            return
        assert self._live is not None
        self._progress.update(self._task, completed=record["step"])
        self._live.update(Group(self._progress, self._table(record)))

    def _table(self, record: dict[str, Any]) -> Table:
        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_row("loss", f"{record['loss']:.4f}", "lr", f"{record['lr']:.3g}",
                      "grad norm", f"{record['grad_norm']:.3g}")
        rate = f"{record['samples_per_s']:.1f} samples/s"
        if "tokens_per_s" in record:
            rate += f"  {record['tokens_per_s']:.0f} tokens/s"
        table.add_row("speed", rate, "bubble", f"{record['bubble']:.3f} (theory {record['bubble_theory']:.3f})",
                      "step", f"{record['step_time_s'] * 1e3:.0f} ms")
        table.add_row("memory", "  ".join(f"s{i}: {human_bytes(m)}" for i, m in enumerate(record["mem_peak_bytes"])),
                      "", "", "", "")
        if self._last_eval is not None:
            ev = self._last_eval
            extra = "  ".join(f"{k} {ev[k]:.4g}" for k in ("accuracy", "bleu") if k in ev)
            table.add_row("eval", f"loss {ev['loss']:.4f}  {extra}", "", "", "at step", str(ev["step"]))
        return table

    def stop(self) -> None:
        """Stop the live view."""
        if self._live is not None:
            self._live.stop()
            self._live = None


def now() -> float:
    """Wall-clock seconds, for record timestamps."""
    return time.time()
