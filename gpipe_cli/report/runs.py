"""Read run directories (recipe.yaml and metrics.jsonl) into the series `gpipe report` draws."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpipe_cli.errors import UserError

# The keys of a train record's time_s, as metrics.jsonl holds them (read from the file, not the engine).
PARTS = ("compute", "wait", "comm", "optimizer", "other")

Series = tuple[list[int], list[float]]  # steps, values


@dataclass
class Run:
    """One run directory's records and what its recipe says about the pipeline."""

    path: Path
    label: str
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stages(self) -> int:
        """Stages of the first replica (as the records hold them)."""
        return len(self.train[-1]["time_s"]["compute"]) if self.train else 0


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line of a run still writing may be partial
            continue
        if isinstance(record, dict) and record.get("kind") in ("train", "eval"):
            out.append(record)
    return out


def _label(recipe: dict[str, Any]) -> str:
    pipe = recipe.get("pipeline") or {}
    label = f"K={pipe.get('partitions', 1)} M={pipe.get('microbatches', 1)} {pipe.get('schedule', 'gpipe')}"
    replicas = pipe.get("data_parallel", 1)
    return label + (f" D={replicas}" if replicas != 1 else "")


def read_run(path: Path) -> Run:
    """A run directory's records, labelled by its K, M and schedule; UserError when it is not one."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path}: not a run directory (no metrics.jsonl); give the folder `gpipe train` wrote")
    recipe: dict[str, Any] = {}
    if (path / "recipe.yaml").is_file():
        loaded = yaml.safe_load((path / "recipe.yaml").read_text(encoding="utf-8"))
        recipe = loaded if isinstance(loaded, dict) else {}
    records = _records(metrics)
    run = Run(path, _label(recipe), [r for r in records if r["kind"] == "train"],
              [r for r in records if r["kind"] == "eval"])
    if not run.train:
        raise UserError(f"{metrics}: holds no train records yet")
    return run


def read_runs(paths: list[Path]) -> list[Run]:
    """Every run, each label unique (the folder name is added where two runs share K, M and schedule)."""
    runs = [read_run(p) for p in paths]
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
