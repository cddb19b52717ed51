"""Read run directories (recipe.yaml and metrics.jsonl) into the series and figures `gpipe report` shows."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpipe_cli.errors import UserError
from gpipe_cli.report.records import PARTS, read_recipe, read_records

__all__ = ["PARTS", "Run", "Throughput", "eval_metric", "read_run", "read_runs", "series", "throughput",
           "time_breakdown"]

Series = tuple[list[int], list[float]]  # steps, values


@dataclass
class Run:
    """One run directory's records and what its recipe says about the pipeline."""

    path: Path
    label: str
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    damage: str = ""  # the lines of metrics.jsonl left out, in words (empty: none)

    @property
    def stages(self) -> int:
        """Stages of the first replica (as the records hold them)."""
        return len(self.train[-1]["time_s"]["compute"]) if self.train else 0


def _label(recipe: dict[str, Any]) -> str:
    pipe = recipe.get("pipeline")
    pipe = pipe if isinstance(pipe, dict) else {}
    label = f"K={pipe.get('partitions', 1)} M={pipe.get('microbatches', 1)} {pipe.get('schedule', 'gpipe')}"
    replicas = pipe.get("data_parallel", 1)
    return label + (f" D={replicas}" if replicas != 1 else "")


def read_run(path: Path) -> Run:
    """A run directory's records, labelled by its K, M and schedule; UserError when it is not one."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path}: not a run directory (no metrics.jsonl); give the folder `gpipe train` wrote")
    recipe = read_recipe(path / "recipe.yaml")
    records = read_records(metrics)
    if not records.train:
        raise UserError(f"{metrics}: holds no train records yet" if not records.damaged else
                        f"{metrics}: holds no usable train record ({records.damage()})")
    return Run(path, _label(recipe), records.train, records.evals, records.damage())


def read_runs(paths: list[Path]) -> list[Run]:
    """Every run, each label unique (the folder name is added where two runs share K, M and schedule)."""
    runs = [read_run(p) for p in paths]
    for run in runs:  # warned once all are read: a run that cannot be read is then the only line
        if run.damage:  # a crash's cut line or a hand edit: the rest of the run is still worth a report
            print(f"warning: {run.path / 'metrics.jsonl'}: skipped {run.damage}", file=sys.stderr)
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({run.path.name})"
    return runs


def _numbers(records: list[dict[str, Any]], get: Any) -> Series:
    steps, values = [], []
    for r in records:
        value = get(r)
        if value is not None:  # null: a non-finite value in metrics.jsonl
            steps.append(int(r["step"]))
            values.append(float(value))
    return steps, values


def eval_metric(run: Run) -> str | None:
    """The eval figure drawn beside the loss: accuracy, else BLEU, else perplexity (None: no evals)."""
    for key in ("accuracy", "bleu", "perplexity"):
        if any(r.get(key) is not None for r in run.evals):
            return key
    return None


def series(run: Run) -> dict[str, Series]:
    """Every curve the report draws for a run, by name: exactly the values of its metrics.jsonl."""
    out: dict[str, Series] = {
        "loss": _numbers(run.train, lambda r: r.get("loss")),
        "samples_per_s": _numbers(run.train, lambda r: r.get("samples_per_s")),
        "bubble": _numbers(run.train, lambda r: r.get("bubble")),
        "bubble_theory": _numbers(run.train, lambda r: r.get("bubble_theory")),
        "eval_loss": _numbers(run.evals, lambda r: r.get("loss")),
    }
    metric = eval_metric(run)
    if metric is not None:
        out[f"eval_{metric}"] = _numbers(run.evals, lambda r: r.get(metric))
    for s in range(run.stages):
        out[f"mem_peak_bytes/stage{s}"] = _numbers(run.train, lambda r, s=s: _at(r.get("mem_peak_bytes"), s))
    return out


def _at(values: Any, index: int) -> Any:
    return values[index] if isinstance(values, list) and index < len(values) else None


def time_breakdown(run: Run) -> dict[str, list[float]]:
    """Mean seconds per step of each part (compute, wait, ...) on each stage, over the run's steps."""
    out = {}
    for part in PARTS:
        per_stage = []
        for s in range(run.stages):
            values = [v for r in run.train if (v := _at(r["time_s"].get(part), s)) is not None]
            per_stage.append(sum(values) / len(values) if values else 0.0)
        out[part] = per_stage
    return out


@dataclass(frozen=True)
class Throughput:
    """A run's mean samples per second, and the steps it is the mean over (in the train summary's words)."""

    samples_per_s: float | None
    over: str


def throughput(run: Run) -> Throughput:
    """All samples over all seconds of the steps after the first (which warms up), as `gpipe train`'s summary
    gives it; a run of one step is the mean over that step."""
    # A step's samples are its rate times its seconds: the global batch, which metrics.jsonl does not hold.
    steps = [(r["samples_per_s"] * r["step_time_s"], r["step_time_s"]) for r in run.train
             if r["samples_per_s"] is not None and r["step_time_s"] is not None]
    over = "the training steps"
    if len(steps) > 1:
        over = f"the steps after the first, which took {steps[0][1]:.2f} s warming up"
        steps = steps[1:]
    seconds = sum(s for _, s in steps)
    return Throughput(sum(n for n, _ in steps) / seconds if seconds > 0 else None, over)
