"""The end-of-run summary: wall time, mean throughput, bubble against theory, best eval, where things are."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpipe_cli.pipeline.stats import PARTS

_NOT_METRICS = ("kind", "step", "nonfinite")


def eval_figures(record: dict[str, Any]) -> str:
    """An eval record's figures, whatever it holds: "loss 1.0530, accuracy 0.9751, bleu 82.81"."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in record.items() if k not in _NOT_METRICS and v is not None)


@dataclass
class RunSummary:
    """Collects the train and eval records of a run (rank 0) and says what happened, in lines."""

    total_steps: int
    started: float  # time.time() of the command's start
    steps: int = 0
    skipped: int = 0
    examples: float = 0.0
    units: float = 0.0
    seconds: float = 0.0
    bubbles: list[float] = field(default_factory=list)
    theory: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    first: tuple[float, float, float] | None = None  # the first step's examples, units and seconds (warm-up)
    steps_seen: tuple[int, int] = (0, 0)  # the first and the last step number taken in
    resumed: bool = False  # the first step came after a resume: the figures are those since it
    best_eval: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None

    def add(self, record: dict[str, Any], examples: float, units: float | None) -> None:
        """Take in one record (train or eval)."""
        if record["kind"] == "eval":
            self.last_eval = record
            loss = record.get("loss")
            if loss is not None and math.isfinite(loss) and (self.best_eval is None or loss < self.best_eval["loss"]):
                self.best_eval = record
            return
        self.steps += 1
        if self.first is None:
            self.first = (examples, units or 0.0, record["step_time_s"])
            self.resumed = record.get("resumed") is True
        self.steps_seen = (self.steps_seen[0] or record["step"], record["step"])
        self.skipped += bool(record.get("skipped"))
        self.examples += examples
        self.units += units or 0.0
        self.seconds += record["step_time_s"]
        self.bubbles.append(record["bubble"])
        self.theory = record["bubble_theory"]
        for part in PARTS:
            values = record["time_s"][part]
            self.parts[part] = self.parts.get(part, 0.0) + sum(values) / len(values)

    def lines(self, now: float, checkpoint: str | None, run_dir: str, text: bool, ended: str = "") -> list[str]:
        """The summary, one fact per line; `text` adds tokens/s; `ended` says why the run stopped early."""
        wall = now - self.started
        done = f"{self.steps} of {self.total_steps} steps"
        if self.resumed:  # the earlier steps' figures are the run's too: `gpipe report` combines them
            done = f"steps {self.steps_seen[0]}-{self.steps_seen[1]} of {self.total_steps}, since the resume,"
        out = [f"summary: {done} in {wall:.1f} s wall time" + (f" ({ended})" if ended else "")]
        if self.steps and self.seconds > 0:
            examples, units, seconds, over = self.examples, self.units, self.seconds, "the training steps"
            if self.steps > 1 and self.first is not None:  # the first step warms up (allocations, lazy init)
                examples, units, seconds = examples - self.first[0], units - self.first[1], seconds - self.first[2]
                over = f"the steps after the first, which took {self.first[2]:.2f} s warming up"
            if self.resumed:
                over += f"; gpipe report {run_dir} gives the whole run's"
            rate = f"{examples / seconds:.1f} samples/s" if seconds > 0 else "-"
            if text and seconds > 0:
                rate += f", {units / seconds:.0f} tokens/s"
            out.append(f"  throughput: {rate} (mean over {over})")
            mean = sum(self.bubbles) / len(self.bubbles)
            out.append(f"  bubble: {mean:.3f} measured (time waiting for a peer), {self.theory:.3f} in theory "
                       f"((K-1)/(M+K-1))")
            total = sum(self.parts.values())
            shares = ", ".join(f"{part} {self.parts[part] / total:.0%}" for part in PARTS) if total else "-"
            out.append(f"  step time: {shares} (mean over stages)")
        best = self.best_eval
        out.append(f"  best eval: step {best['step']}: {eval_figures(best)}" if best else "  best eval: none")
        out.append(f"  skipped steps: {self.skipped}")
        out.append(f"  checkpoint: {checkpoint or 'none written'}")
        out.append(f"  run directory: {run_dir}")
        return out
