"""Read run directories (recipe.yaml, metrics.jsonl's usable records) into the series and figures of `gpipe report`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpipe_cli.errors import UserError, path_line
from gpipe_cli.recipe.yamlio import parse_document, read_recipe_file
from gpipe_cli.records import (
    PARTS,
    PIPELINE,
    PROFILED,
    RESUMED,
    WARMUP,
    Rate,
    after_warmup,
    profiled_words,
    read_records,
)
from gpipe_cli.runs import kept_by_a_run
from gpipe_cli.units import number_range

Series = tuple[list[int], list[float]]  # steps, values
Starts = list[list[dict[str, Any]]]  # a run's train records, one list per start (the first and each resume)


@dataclass
class Run:
    """One run directory's records and what its recipe says about the pipeline."""

    path: Path
    label: str  # its last start's pipeline (the one its recipe.yaml now holds)
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    damage: str = ""  # the lines of metrics.jsonl left out, in words (empty: none)
    recipe: dict[str, Any] = field(default_factory=dict)  # the recipe's pipeline section: records without PIPELINE
    planned: int | None = None  # the recipe's train.steps, where no train.epochs may end it sooner
    # Some records hold their M and schedule: a resume by a later version rewrote recipe.yaml, which then describes
    # its start only, not the records of the version before it that hold none.
    recorded: bool = False

    @property
    def stages(self) -> int:
        """Stages of the first replica (as the records hold them)."""
        return len(self.train[-1]["time_s"]["compute"]) if self.train else 0

    def settings(self, record: dict[str, Any]) -> dict[str, Any]:
        """The M, schedule and D a train record was written with; the recipe's for records without them."""
        pipe = {"microbatches": 1, "schedule": "gpipe", "data_parallel": 1, **self.recipe}
        return pipe | {key: record[key] for key in PIPELINE if key in record}

    @property
    def schedule(self) -> str:
        """The schedule its last start ran (the one its label names)."""
        return str(self.settings(self.train[-1])["schedule"])

    def unrecorded(self, record: dict[str, Any]) -> bool:
        """Whether a record's M and schedule are unknown: none recorded, and the recipe is a later start's."""
        return self.recorded and not all(key in record for key in PIPELINE)

    def pipeline(self, record: dict[str, Any]) -> str:
        """The K, M, schedule (and D) a train record was written with; the recipe's for records without them."""
        stages = f"K={len(record['time_s']['compute'])}"
        if self.unrecorded(record):
            return f"{stages} (M and schedule unrecorded)"
        pipe = self.settings(record)
        label = f"{stages} M={pipe['microbatches']} {pipe['schedule']}"
        return label + (f" D={pipe['data_parallel']}" if pipe["data_parallel"] != 1 else "")


def read_run(path: Path) -> Run:
    """A run directory's records, labelled by its K, M and schedule; UserError when it is not one."""
    metrics = path / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{path}: no such run directory; give the folder `gpipe train` wrote")
    if not path.is_dir():
        raise UserError(f"{path}: is a file, not a run directory; give the folder `gpipe train` wrote"
                        + (f" ({path.parent})" if path.name == "metrics.jsonl" else ""))
    if metrics.is_dir():
        raise UserError(f"{metrics}: is a directory, not a run's records file; give the folder `gpipe train` wrote")
    if metrics.exists() and not metrics.is_file():  # reading a FIFO would wait for a writer for ever
        raise UserError(f"{metrics}: is a pipe, socket or device, not a run's records file; give the folder "
                        "`gpipe train` wrote")
    if not metrics.is_file():
        from gpipe_cli.train.claim import LOCK  # only on this way out, as the rest
        from gpipe_cli.train.existing import check_not_runs  # it reads recipes

        if (path / LOCK).is_file():  # a gpipe train starting here, or one whose launch was killed before its ranks
            raise NotStarted(f"{path}: no metrics.jsonl yet (a run starting, or stopped before its first step)")

        if (kept := kept_by_a_run(path)) is not None:  # its checkpoints/ or a course a resume set aside there
            raise UserError(f"{path}: checkpoints of a run, not a run directory; give the run: {kept[0]}")
        check_not_runs(path)
        raise UserError(f"{path}: not a run directory (no metrics.jsonl); give the folder `gpipe train` wrote")
    recipe_file = path / "recipe.yaml"  # none, or one that is not a mapping: the defaults' K, M and schedule
    recipe = parse_document(read_recipe_file(recipe_file), str(recipe_file)) if recipe_file.is_file() else {}
    pipe = recipe.get("pipeline") if isinstance(recipe, dict) else None
    train, evals, damage = read_records(metrics)
    if damage and not train:
        raise UserError(f"{metrics}: holds no usable train record ({damage})")
    if not train:
        raise NotStarted(f"{metrics}: holds no train records yet")
    run = Run(path, "", train, evals, damage, pipe if isinstance(pipe, dict) else {})
    run.recorded = any(all(key in record for key in PIPELINE) for record in train)
    settings = recipe.get("train") if isinstance(recipe, dict) else None
    if isinstance(settings, dict) and settings.get("epochs") is None and type(settings.get("steps")) is int:
        run.planned = settings["steps"]
    run.label = run.pipeline(train[-1])
    return run


class NotStarted(UserError):
    """A run directory whose run has not recorded its first step (still starting, or stopped before it)."""


def read_runs(paths: list[Path]) -> list[Run]:
    """Every run, each label unique (the folder name is added where two runs share K, M and schedule)."""
    runs, waiting = [], []
    for path in paths:
        try:
            runs.append(read_run(path))
        except NotStarted as exc:  # `outputs/x/*` takes in a run just starting: the others still make a report
            waiting.append(exc)
    if waiting and not runs:
        raise waiting[0]
    for line in waiting:
        print(f"warning: {line}; left out", file=sys.stderr)
    for run in runs:  # warned once all are read: a run that cannot be read is then the only line
        if run.damage:  # a crash's cut line or a hand edit: the rest of the run is still worth a report
            print(f"warning: {run.path / 'metrics.jsonl'}: skipped {run.damage}", file=sys.stderr)
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({path_line(run.path.name)})"
    return runs


def _numbers(records: list[dict[str, Any]], get: Any) -> Series:
    """The steps and values of the records that hold a number (`get`: a key or how to read one)."""
    read = [(int(r["step"]), r.get(get) if isinstance(get, str) else get(r)) for r in records]
    pairs = [(step, float(value)) for step, value in read if value is not None]  # null: not finite when written
    return [step for step, _ in pairs], [value for _, value in pairs]


# The task metrics an eval record may hold, each drawn in its own panel.
EVAL_METRICS = ("accuracy", "bleu", "perplexity")
TIMED = ("samples_per_s", "bubble", "bubble_theory")  # curves of the steps after warm-up


def _exp(loss: float | None) -> float | None:
    """exp(loss), None where it is not finite (a null loss, or one past a float's range)."""
    return math.exp(loss) if loss is not None and loss < 700 else None


def eval_metric(run: Run) -> str | None:
    """The eval figure the summary table shows: BLEU, else perplexity, else accuracy (None: no evals)."""
    # Text evals hold token accuracy too: a language model is judged by its perplexity, a translation by BLEU.
    return next((key for key in HEADLINE if any(r.get(key) is not None for r in run.evals)), None)


HEADLINE = {"bleu": "BLEU", "perplexity": "ppl", "accuracy": "acc"}  # by precedence, with the table's short name


def warm(records: list[dict[str, Any]]) -> int:
    """How many of a start's records lead it warming up: its first, but for a course a resume set aside that goes
    on from a start recorded in its run (its first step is then as any other)."""
    first = records[0] if records else {}
    return int(first.get(WARMUP) is True or first.get(RESUMED) is True or first.get("step") == 1)


def warm_only(starts: Starts) -> bool:
    """Whether every step of these starts is a start's first: the warm-up steps are then all there is, and kept."""
    return not any(records[warm(records):] for records in starts)


def _after(starts: Starts) -> list[list[dict[str, Any]]]:
    """Each start's records after its warm-up step (all of them, where the warm-up steps are all there is)."""
    only = warm_only(starts)
    return [records if only else records[warm(records):] for records in starts]


def _steady(starts: Starts) -> list[dict[str, Any]]:
    return [r for records in _after(starts) for r in records]


def steady(run: Run) -> list[dict[str, Any]]:
    """The run's train records but its warm-up steps (each start's first), whose one-time costs would swamp timing."""
    return _steady(segments(run))


def steady_now(run: Run) -> list[dict[str, Any]]:
    """The steady steps (`steady`) of the run's last pipeline but the profiled ones: what its mean figures are of."""
    return [r for records in _after(last_cut(run)) for r in _unprofiled(records)]


def profiled_left_out(run: Run) -> list[int]:
    """The profiled steps of the run's last pipeline that its mean figures leave out (`steady_now`)."""
    return [step for records in _after(last_cut(run)) for step in _left_out(records)]


def _unprofiled(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records but those of profiled steps, whose time holds the profiler's (kept when they are all there are)."""
    return [r for r in records if r.get(PROFILED) is not True] or records


def _left_out(records: list[dict[str, Any]]) -> list[int]:
    """The profiled steps `_unprofiled` leaves out of these records."""
    kept = _unprofiled(records)
    return [r["step"] for r in records if r.get(PROFILED) is True and kept is not records]


def last_cut(run: Run) -> Starts:
    """The starts since the run's pipeline last changed: the only ones whose stages are the run's stages now."""
    starts = segments(run)
    now = run.pipeline(starts[-1][0])
    first = len(starts)
    while first > 0 and run.pipeline(starts[first - 1][0]) == now:
        first -= 1
    return starts[first:]


def cut_steps(run: Run) -> str | None:
    """The steps of the run's last pipeline, "21-22", when earlier steps ran another (None: one pipeline)."""
    starts = last_cut(run)
    if len(starts) == len(segments(run)):
        return None
    return number_range(starts[0][0]["step"], starts[-1][-1]["step"])


def steps_words(span: str) -> str:
    """A range of steps in words: "steps 3-4", or "step 3" for a range of one."""
    return f"step{'s' if '-' in span else ''} {span}"


def series(run: Run) -> dict[str, Series]:
    """Every curve the report draws for a run, by name; the timing figures (throughput, bubble) skip warm-up steps."""
    timed = steady(run)
    out = {"loss": _numbers(run.train, "loss"), **{key: _numbers(timed, key) for key in TIMED},
           "eval_loss": _numbers(run.evals, "loss")}
    out |= {f"eval_{metric}": _numbers(run.evals, metric) for metric in (*EVAL_METRICS, "unigram_perplexity")
            if any(r.get(metric) is not None for r in run.evals)}
    if any("tokens_per_s" in r for r in run.train):  # a text task: its loss is a mean per-token cross-entropy
        out["perplexity"] = _numbers(run.train, lambda r: _exp(r.get("loss")))
    out |= {key: _numbers(timed, key) for key in ("tflops", "mfu") if any(r.get(key) is not None for r in timed)}
    # Stage s of another pipeline holds other layers: a stage's curve is of the last pipeline's steps alone.
    cut = [r for records in last_cut(run) for r in records]
    for s in range(run.stages):
        out[f"mem_peak_bytes/stage{s}"] = _numbers(cut, lambda r, s=s: _at(r.get("mem_peak_bytes"), s))
    return out


def _at(values: Any, index: int) -> Any:
    return values[index] if isinstance(values, list) and index < len(values) else None


def time_breakdown(run: Run) -> dict[str, list[float]]:
    """Mean seconds per step of each part on each stage, over the last pipeline's steps but the warm-up ones."""
    timed = steady_now(run)
    return {part: [_mean([v for r in timed if (v := _at(r["time_s"].get(part), s)) is not None])
                   for s in range(run.stages)] for part in PARTS}


def timed_mean(run: Run, key: str) -> float | None:
    """A train figure's mean over the last pipeline's steps after warm-up, each step weighted by its time."""
    # Weighted as samples/s is (all samples over all seconds), so that the run table's figures agree: a stage's
    # parts add up to the step, so the bubble weighted so is all the stages' time waiting over all their time.
    pairs = [(r[key], r["step_time_s"]) for r in steady_now(run) if r.get(key) is not None
             and r["step_time_s"] is not None]
    seconds = sum(t for _, t in pairs)
    return sum(v * t for v, t in pairs) / seconds if seconds > 0 else None


def wait_share(run: Run) -> float | None:
    """The share of every stage's time spent waiting, over the last pipeline's steps after warm-up (None: no time)."""
    timed = steady_now(run)
    seconds = {part: sum(v for r in timed for v in r["time_s"][part] if v is not None) for part in PARTS}
    total = sum(seconds.values())
    return seconds["wait"] / total if total else None


def memory_peak(run: Run) -> float | None:
    """The largest memory peak of any stage at any step, whatever pipeline ran it (None: no record holds one)."""
    return max((float(v) for r in run.train for v in r.get("mem_peak_bytes") or [] if v is not None), default=None)


def on_gpu(run: Run) -> bool:
    """Whether the run's memory figures are CUDA allocator peaks; else (a CPU run) the activations its stages stored."""
    return any(r.get("cuda_peak_bytes") for r in run.train)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class Throughput:
    """A mean samples per second, the steps it covers, and what it is the mean over (in the train summary's words)."""

    samples_per_s: float | None
    over: str
    steps: str = ""  # "5-8": the steps of one start of the run (a resume starts one)
    warmup_s: float | None = None  # the first step's seconds, left out of the mean


def segments(run: Run) -> Starts:
    """The run's train records split where it was resumed: each segment the steps of one `gpipe train`."""
    out: Starts = []
    for record in run.train:
        if not out or record.get(RESUMED) is True or record.get(WARMUP) is True:
            out.append([])
        out[-1].append(record)
    return out


Timed = list[tuple[float, float]]  # samples, seconds of each step


def _timed(records: list[dict[str, Any]]) -> Timed:
    # A step's samples are its rate times its seconds: the global batch, which metrics.jsonl does not hold.
    return [(r["samples_per_s"] * r["step_time_s"], r["step_time_s"]) for r in records
            if r["samples_per_s"] is not None and r["step_time_s"] is not None]


def _rate(steps: Timed) -> Rate:
    return Rate(sum(n for n, _ in steps), sum(s for _, s in steps), len(steps))


def _segment(records: list[dict[str, Any]]) -> Throughput:
    """One start's throughput as its `gpipe train` summary gives it."""
    w = warm(records)
    steps = _timed(records[:w] + _unprofiled(records[w:]))
    shown, over = after_warmup(_rate(steps[:w]), _rate(steps[w:]))
    if len(steps) > w:
        over += profiled_words(_left_out(records[w:]))
    return Throughput(shown.per_s, over, number_range(records[0]['step'], records[-1]['step']),
                      steps[0][1] if w and len(steps) > 1 else None)


def segment_throughputs(run: Run) -> list[Throughput]:
    """The throughput of each start of the run (the first and each resume), as its `gpipe train` summary gave it."""
    return [_segment(records) for records in segments(run)]


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def throughput(run: Run) -> Throughput:
    """All samples over all seconds of the last pipeline's steps after each start's first, as `gpipe train` sums."""
    parts, span = last_cut(run), cut_steps(run)
    if len(parts) == 1 and span is None:
        return _segment(parts[0])
    ws = [warm(records) for records in parts]
    timed = [_timed(records[:w] + _unprofiled(records[w:])) for records, w in zip(parts, ws, strict=True)]
    firsts = _rate([steps[0] for steps, w in zip(timed, ws, strict=True) if steps and w])
    shown, over = after_warmup(firsts, _rate([step for steps, w in zip(timed, ws, strict=True) for step in steps[w:]]))
    warmups = _and([f"{steps[0][1]:.2f}" for steps, w in zip(timed, ws, strict=True) if steps and w] or ["0"])
    warming = shown is not firsts and firsts.steps > 0
    if span is not None:  # resumed with another pipeline: the steps since, whose K, M and schedule the row has
        over = f"{steps_words(span)} only, its last pipeline"
        if warming:
            each = f" of each start (at steps {_and([str(records[0]['step']) for records in parts])})"
            over += f", after the first{each if len(parts) > 1 else ''}, which took {warmups} s warming up"
    elif warming:  # the steps after every start's warm-up step: each start named
        at = f"step{'s' if len(parts) > 2 else ''} " + _and([str(records[0]["step"]) for records in parts[1:]])
        # A course a resume set aside goes on from a start recorded in its run: only its resumes warmed up here.
        whose = "the run and of each resume" if ws[0] else "each resume" if len(parts) > 2 else "the resume"
        over = f"the steps after the first of {whose} (at {at}), which took {warmups} s warming up"
    if shown is not firsts:
        over += profiled_words([step for records, w in zip(parts, ws, strict=True) for step in _left_out(records[w:])])
    return Throughput(shown.per_s, over)
