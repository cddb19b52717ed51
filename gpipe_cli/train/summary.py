"""The end-of-run summary: wall time, mean throughput, bubble against theory, best eval, where things are."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpipe_cli.errors import path_line, shell_path
from gpipe_cli.pipeline.stats import PARTS
from gpipe_cli.records import PIPELINE, PROFILED, Rate, after_warmup, profiled_words, read_records
from gpipe_cli.train.step_figures import Peak
from gpipe_cli.units import flop_rate, number_range, share

_NOT_METRICS = ("kind", "step", "nonfinite")


def eval_figures(record: Mapping[str, Any]) -> str:
    """An eval record's figures, whatever it holds: "loss 1.0530, accuracy 0.9751, bleu 82.81"."""
    # A share to four places, so that 1 reads 1.0000 beside 0.9751; other figures to four digits.
    return ", ".join(f"{_WORDS.get(k, k)} {v:.4f}" if k == "accuracy" and isinstance(v, float)
                     else f"{_WORDS.get(k, k)} {v:.4g}" if isinstance(v, float) else f"{_WORDS.get(k, k)} {v}"
                     for k, v in record.items() if k not in _NOT_METRICS and v is not None)


_WORDS = {"unigram_perplexity": "unigram perplexity"}  # a record's keys as the line's words


@dataclass
class _Steps(Rate):
    """What a group of train steps adds up to."""

    units: float = 0.0
    flops: float = 0.0  # model FLOPs, of the steps whose records carry `tflops`
    waiting: float = 0.0  # bubble x step time: weighted as the throughput is, and as `gpipe report` weights it
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, record: Mapping[str, Any], examples: float, units: float | None) -> None:
        """Take in one train record."""
        self.steps += 1
        self.samples += examples
        self.units += units or 0.0
        self.seconds += record["step_time_s"]
        self.flops += record.get("tflops", 0.0) * 1e12 * record["step_time_s"]
        self.waiting += record["bubble"] * record["step_time_s"]
        for part in PARTS:
            values = record["time_s"][part]
            self.parts[part] = self.parts.get(part, 0.0) + sum(values) / len(values)


def pipeline_of(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """The K, M, schedule and D a train record was written with (None where a record of an older version is silent)."""
    return (len(record["time_s"]["compute"]), *(record.get(key) for key in PIPELINE))


@dataclass
class RunSummary:
    """Collects the train and eval records of a run (rank 0) and says what happened, in lines."""

    total_steps: int
    started: float  # time.time() of the command's start
    steps: int = 0
    skipped: int = 0
    theory: float = 0.0
    formula: str = "(K-1)/(M+K-1)"  # the schedule's bubble in closed form, or "of <schedule>"
    # The warm-up step (the first of a start, marked `warmup`: allocations, lazy set-up) and the others: the
    # throughput, bubble and step-time shares are those of the others, when there are any.
    warmup: _Steps = field(default_factory=_Steps)
    measured: _Steps = field(default_factory=_Steps)
    # Steps whose time holds the profiler's (marked `profiled`): left out of the figures but where they are all.
    profiled: _Steps = field(default_factory=_Steps)
    profiled_steps: list[int] = field(default_factory=list)
    steps_seen: tuple[int, int] = (0, 0)  # the first and the last step number taken in
    resumed: bool = False  # the first step came after a resume: the figures are those since it
    best_eval: Mapping[str, Any] | None = None
    peak: Peak | None = None  # what MFU is measured against (rank 0 sets it once it knows)
    ranks: int = 1
    last_eval: Mapping[str, Any] | None = None
    # The K, M, schedule and D of the steps before a resume, and of this start's first: `gpipe report` gives a
    # whole run's throughput only where they are the same.
    earlier_pipelines: set[tuple[Any, ...]] = field(default_factory=set)
    pipeline: tuple[Any, ...] | None = None

    def add(self, record: Mapping[str, Any], examples: float, units: float | None) -> None:
        """Take in one record (train or eval)."""
        if record["kind"] == "eval":
            self.last_eval = record
            loss = record.get("loss")
            if loss is not None and math.isfinite(loss) and (self.best_eval is None or loss < self.best_eval["loss"]):
                self.best_eval = record
            return
        if not self.steps:
            self.resumed = record.get("resumed") is True
            self.pipeline = pipeline_of(record)
        # The first step taken in is a start's first, whether or not its record says so.
        warm = record.get("warmup") is True or not self.steps
        self.steps += 1
        self.steps_seen = (self.steps_seen[0] or record["step"], record["step"])
        self.skipped += bool(record.get("skipped"))
        self.theory = record["bubble_theory"]
        if not warm and record.get(PROFILED) is True:
            self.profiled.add(record, examples, units)
            self.profiled_steps.append(record["step"])
            return
        (self.warmup if warm else self.measured).add(record, examples, units)

    def take_earlier(self, metrics: Path, step: int) -> None:
        """Take in what a run resumed at `step` recorded before it: its best eval is the whole run's."""
        train, evals, _ = read_records(metrics) if step and metrics.is_file() else ([], [], "")
        for record in evals:
            if record["step"] <= step:
                self.add(record, 0, None)
        self.earlier_pipelines = {pipeline_of(record) for record in train if record["step"] <= step}

    def lines(self, now: float, checkpoint: str | None, run_dir: str, text: bool, ended: str = "") -> list[str]:
        """The summary, one fact per line; `text` adds tokens/s; `ended` says why the run stopped early."""
        wall = now - self.started
        done = f"{self.steps} of {self.total_steps} steps"
        if self.resumed:  # the earlier steps' figures are the run's too: `gpipe report` combines them
            first, last = self.steps_seen
            done = (f"step{'s' if last > first else ''} {number_range(first, last)} of {self.total_steps}, "
                    "since the resume,")
        out = [f"summary: {done} in {wall:.1f} s wall time" + (f" ({ended})" if ended else "")]
        after = self.measured if self.measured.steps else self.profiled  # profiled steps alone: all there is
        shown, over = after_warmup(self.warmup, after)
        if shown is self.measured:
            over += profiled_words(self.profiled_steps)
        if shown.per_s is not None:
            if self.resumed:
                # Any earlier start on another pipeline: the report then gives each start's figure.
                changed = any(None not in earlier and earlier != self.pipeline for earlier in self.earlier_pipelines)
                over += f"; gpipe report {shell_path(run_dir)} gives {'each start' if changed else 'the whole run'}'s"
            rate = f"{shown.per_s:.1f} samples/s"
            if text:
                rate += f", {shown.units / shown.seconds:.0f} tokens/s"
            out.append(f"  throughput: {rate} (mean over {over})")
            if shown.flops > 0:
                out.append(f"  model FLOPs: {self._utilization(shown)}")
            mean = shown.waiting / shown.seconds if shown.seconds else 0.0
            out.append(f"  bubble: {mean:.3f} measured (time waiting for a peer), {self.theory:.3f} in theory "
                       f"({self.formula})")
            total = sum(shown.parts.values())
            shares = ", ".join(f"{part} {shown.parts[part] / total:.0%}" for part in PARTS) if total else "-"
            out.append(f"  step time: {shares} (mean over stages)")
        best, final = self.best_eval, self.last_eval
        # The run's final eval is printed here only (the view leaves it out), once: as the best when it is.
        if final is not None and final["step"] == self.total_steps and final is not best:
            out.append(f"  final eval: step {final['step']}: {eval_figures(final)}")
        return [*out, f"  best eval: step {best['step']}: {eval_figures(best)}" if best else "  best eval: none",
                f"  skipped steps: {self.skipped}",
                f"  checkpoint: {path_line(checkpoint) if checkpoint else 'none written'}",
                f"  run directory: {path_line(run_dir)}"]

    def _utilization(self, shown: _Steps) -> str:
        """Mean achieved model TFLOP/s of all ranks, and MFU against what the peak is (when known)."""
        achieved = shown.flops / shown.seconds
        text = flop_rate(achieved) + " (all ranks)"
        if self.peak is not None and self.peak.flops_per_s:
            text += (f", MFU {share(achieved / (self.peak.flops_per_s * self.ranks))} against {self.ranks} "
                     f"rank{'s' if self.ranks != 1 else ''} x {self.peak.source}")
        elif self.peak is not None:
            text += f" ({self.peak.source})"
        return text
