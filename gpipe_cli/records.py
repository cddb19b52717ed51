"""A step's record as metrics.jsonl holds it: written by the training loop, read by the sinks and `gpipe report`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar

from gpipe_cli.errors import UserError
from gpipe_cli.units import number_range

# No torch and no engine here: `gpipe report` reads runs without importing either (a test pins PARTS to the engine's).

# The keys of a train record's time_s: each a list of seconds per stage, adding up to step_time_s.
PARTS = ("compute", "wait", "comm", "optimizer", "other")
# A train record's figures that are numbers (null where they were not finite).
TRAIN_NUMBERS = ("samples_per_s", "step_time_s", "loss", "bubble", "bubble_theory", "tokens_per_s", "tflops", "mfu")
EVAL_NUMBERS = ("loss", "accuracy", "bleu", "perplexity")
# A step's timing figures: a warm-up step's carry one-time costs (its loss, lr and memory are as any step's).
TIMING = frozenset({"samples_per_s", "tokens_per_s", "step_time_s", "bubble", "idle", "time_s", "tflops", "mfu"})
# True on the first train record of every start (the run's first step and the first after each resume): it
# carries one-time costs (allocations, lazy set-up). Runs recorded before the mark existed have the same
# steps as their first record and their `resumed` ones.
WARMUP = "warmup"
# True on the first train record after a resume: that step warms up again, as the run's first did.
RESUMED = "resumed"
# True on a train record whose time holds the profiler's work (train.profile): starting it, recording, writing
# the trace (seconds on a CPU). The mean timing figures leave these steps out, as they do warm-up steps.
PROFILED = "profiled"
# A train record's pipeline beside its stages (the length of its per-stage lists): a resume may change any of them.
PIPELINE: dict[str, type] = {"microbatches": int, "schedule": str, "data_parallel": int}  # key -> type


@dataclass
class Rate:
    """Samples and seconds of some train steps, added up."""

    samples: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    @property
    def per_s(self) -> float | None:
        """Samples per second (None: no time)."""
        return self.samples / self.seconds if self.seconds > 0 else None


R = TypeVar("R", bound=Rate)


def after_warmup(warmup: R, after: R) -> tuple[R, str]:
    """A start's steps its mean figures are over, and in words: those after its warm-up step, else that step alone."""
    if after.steps and warmup.steps:
        return after, f"the steps after the first, which took {warmup.seconds:.2f} s warming up"
    return (after, "the training steps") if after.steps else (warmup, "the training steps")


def profiled_words(steps: Sequence[int]) -> str:
    """The profiled steps a mean leaves out, in words: ", and not the 2 profiled (steps 3-4)"; "" for none."""
    if not steps:
        return ""
    spans: list[list[int]] = []
    for step in sorted(steps):
        if spans and step == spans[-1][-1] + 1:
            spans[-1].append(step)
        else:
            spans.append([step])
    named = ", ".join(number_range(span[0], span[-1]) for span in spans)
    if len(steps) == 1:
        return f", and not step {named}, which was profiled"
    return f", and not the {len(steps)} profiled (steps {named})"


class _TrainFigures(TypedDict):
    kind: Literal["train"]
    step: int
    epoch: int
    loss: float
    lr: float
    samples_per_s: float
    step_time_s: float
    bubble: float
    bubble_theory: float
    idle: float
    time_s: dict[str, list[float]]   # part -> seconds per stage (PARTS)
    rss_peak_bytes: list[int]
    grad_norm: float
    microbatches: int                 # PIPELINE: M, the schedule and D of the start that wrote it
    schedule: str
    data_parallel: int


class Utilization(TypedDict, total=False):
    """A step's achieved model TFLOP/s (all ranks) and its share of their peak, when the peak is known."""

    tflops: float
    mfu: float


class TrainRecord(_TrainFigures, Utilization, total=False):
    """One training step: what it cost, where each stage's time went, and what it held."""

    activation_peak_bytes: list[int]  # when the step counted its stored activations
    mem_peak_bytes: list[int]
    cuda_peak_bytes: list[int]
    tokens_per_s: float               # text models
    skipped: bool                     # a non-finite step left out of the update
    loss_scale: float                 # fp16: the loss scale after this step
    warmup: bool                      # see WARMUP
    resumed: bool                     # see RESUMED
    profiled: bool                    # see PROFILED


class EvalFigures(TypedDict, total=False):
    """What an evaluation measures beside its loss."""

    accuracy: float
    perplexity: float
    unigram_perplexity: float         # a baseline the model should beat (text)
    bleu: float


class _EvalKeys(TypedDict):
    kind: Literal["eval"]
    step: int
    loss: float


class EvalRecord(_EvalKeys, EvalFigures):
    """One evaluation of the held-out split."""


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _are_numbers(values: Any) -> bool:
    return isinstance(values, list) and all(_is_number(v) for v in values)


def usable(record: dict[str, Any]) -> bool:
    """Whether a train or eval record holds every figure the report reads, each of the right type."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return False
    if record["kind"] == "eval":
        return all(_is_number(record.get(key)) for key in EVAL_NUMBERS)
    time_s = record.get("time_s")
    return (all(key in record for key in ("samples_per_s", "step_time_s"))
            and all(_is_number(record.get(key)) for key in TRAIN_NUMBERS)
            and isinstance(time_s, dict) and all(_are_numbers(time_s.get(part)) for part in PARTS)
            and bool(time_s["compute"])
            and all(type(record.get(key, kind())) is kind for key, kind in PIPELINE.items())  # a bool is no count
            and (record.get("mem_peak_bytes") is None or _are_numbers(record["mem_peak_bytes"])))


def read_records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The usable train and eval records of a metrics.jsonl, and the lines that are not in words (empty: none)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    lines = data.split(b"\n")
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    damaged: list[int] = []  # the numbers of the malformed lines, from 1
    unended = ""
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past what Python parses
            if number < len(lines):
                damaged.append(number)
            else:  # unended: still being written, or cut by a crash; said apart, as it is not damage
                unended = f"the last line ({number}), unfinished: still being written or cut short"
            continue
        if not isinstance(record, dict):
            damaged.append(number)
        elif record.get("kind") in ("train", "eval"):  # other kinds, should there ever be any, are not read
            if usable(record):
                (train if record["kind"] == "train" else evals).append(record)
            else:
                damaged.append(number)
    words = ("" if not damaged else f"1 malformed line (line {damaged[0]})" if len(damaged) == 1
             else f"{len(damaged)} malformed lines, the first on line {damaged[0]}")
    return train, evals, "; ".join(part for part in (words, unended) if part)
