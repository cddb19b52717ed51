"""Saving and restoring a run's state around the checkpoint files (see checkpoint.py for the format)."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpipe_cli.errors import UserError, path_line
from gpipe_cli.files import atomic_write_bytes, space_left
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.topology import Topology
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe.yamlio import parse_document, read_recipe_file
from gpipe_cli.runs import METRICS, RECIPE
from gpipe_cli.train import checkpoint
from gpipe_cli.train.existing import no_usable
from gpipe_cli.train.plan import Plan
from gpipe_cli.train.safe_dcp import saved_keys


def saved_cut(location: str, recipe: Recipe, layers: int) -> list[int] | None:
    """The cut the newest whole checkpoint at `location` was written with, when a resumed run should keep it."""
    # A measured cut may come out differently on each launch; any cut could load, but the saved one also keeps
    # each rank's RNG streams, so the run continues exactly as if uninterrupted.
    pipe = recipe.pipeline
    if pipe.balance not in ("auto", "time", "memory"):
        return None
    found, _ = checkpoint.newest_whole(Path(location))
    if found is None:
        return None
    saved: Any = found.manifest.get("balance")
    same = found.manifest.get("partitions") == pipe.partitions and found.manifest.get("data_parallel") == \
        pipe.data_parallel
    valid = (isinstance(saved, list) and len(saved) == pipe.partitions * pipe.virtual_stages
             and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in saved)
             and sum(saved) == layers)
    return list(saved) if same and valid else None


def split_rule_changed(then: Any, now: dict[str, Any]) -> bool:
    """Whether a checkpoint predates holding data out by content, which this run's held-out split is chosen by."""
    return not isinstance(then, dict) and now.get("held_out_by") == "content"  # older versions recorded no counts


def eval_cut_changed(then: Any) -> bool:
    """Whether a checkpoint predates cutting the held-out batches without regard to M x D."""
    return not (isinstance(then, dict) and "held_out_batches" in then)


def data_change(then: Any, now: dict[str, Any]) -> str:
    """How the run's data counts differ from those a checkpoint recorded, in words ('' when alike or unrecorded)."""
    if not isinstance(then, dict) or not now:  # a checkpoint of an older version records none
        return ""
    words = {"train_examples": "training examples", "held_out": "held out"}
    return " and ".join(f"{words[key]} {then[key]:,} then, {now[key]:,} now" for key in words
                        if isinstance(then.get(key), int) and key in now and then[key] != now[key])


class Checkpointer:
    """Writes and reads this rank's part of the run's checkpoints."""

    def __init__(self, pipe: Pipeline, optimizer: torch.optim.Optimizer | None,
                 scheduler: torch.optim.lr_scheduler.LambdaLR | None, topo: Topology, plan: Plan,
                 run_dir: Path, keep: int, settings: bytes = b"", data: dict[str, Any] | None = None) -> None:
        self.pipe, self.optimizer, self.scheduler, self.topo, self.plan = pipe, optimizer, scheduler, topo, plan
        self.run_dir, self.keep = run_dir, keep
        self.settings = settings  # the run's resolved recipe, kept in each checkpoint: a resume back to it reads them
        self.data = data or {}  # how much data the run read (rank 0): a resume says when it has changed
        self.layout = topo.layout
        self.last_saved = -1

    def _layout(self) -> dict[str, Any]:
        return {"partitions": self.layout.stages, "data_parallel": self.layout.replicas, "balance": self.plan.balance}

    def _extra(self, step: int, same_layout: bool) -> dict[str, Any]:
        extra: dict[str, Any] = {"train": {"step": torch.tensor(step), "loss_scale": self.pipe.loss_scale.state()}}
        if same_layout:  # RNG streams belong to ranks; they only carry over onto the same ranks
            rng = {"cpu": torch.get_rng_state()}
            if self.topo.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.topo.device)
            extra[f"rng.rank{self.layout.rank}"] = rng
        return extra

    def save(self, step: int, epoch: int) -> Path:
        """Write the checkpoint after `step` optimizer steps (collective)."""
        path = checkpoint.path_for(self.run_dir, step)
        state = checkpoint.state_of(self.pipe.module, self.optimizer, self._extra(step, same_layout=True))
        manifest = {"step": step, "epoch": epoch, **self._layout(), "world_size": self.layout.world_size,
                    **({"data": self.data} if self.data else {})}
        checkpoint.save(path, state, manifest, self.keep, self.layout.rank, self.topo.transport.control,
                        {RECIPE: self.settings} if self.settings else {})
        self.last_saved = step
        return path

    def restore(self, found: checkpoint.Found) -> int:
        """Load a checkpoint into this rank's stage and optimizer; return the step to continue from."""
        layout = self._layout()
        same = all(found.manifest.get(k) == v for k, v in layout.items())
        wanted = self._extra(0, same)
        rng_key = f"rng.rank{self.layout.rank}"
        if same and "cuda" in wanted[rng_key] and f"{rng_key}.cuda" not in (saved_keys(found.path) or ()):
            del wanted[rng_key]["cuda"]  # written on the CPU: there is no CUDA RNG state to restore
        # An optimizer's state carries its settings, which would undo a resume's --set of momentum or weight
        # decay that the resume had just announced: the recipe's own are put back.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups] \
            if self.optimizer is not None else []
        extra = checkpoint.load(found, self.pipe.module, self.optimizer, wanted, self.pipe.tied)
        for group, own in zip(self.optimizer.param_groups if self.optimizer is not None else [], settings):
            group.update(own)
        step = int(extra["train"]["step"])
        # A checkpoint of fp32 or bf16 training, resumed as fp16, leaves the scale to start afresh: its 1.0 would
        # take 2,000 clean steps to grow.
        if _precision(found.path) in ("fp16", None):
            self.pipe.loss_scale.load(extra["train"]["loss_scale"])
        if same:
            rng = extra[f"rng.rank{self.layout.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.topo.device)
        if self.scheduler is not None:  # the learning rate is a function of the step alone
            self.scheduler.last_epoch = step - 1
            with warnings.catch_warnings():  # torch warns of a step before the optimizer's: here it is on purpose
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                self.scheduler.step()
        self.last_saved = step
        return step

    def resume(self, location: str) -> checkpoint.Found:
        """Load the newest usable checkpoint at a --resume location (collective), a line for each newer one skipped."""
        paths = self.topo.share([str(p) for p in checkpoint.candidates(Path(location))] if self.layout.rank == 0
                                else None)
        refused: list[str] = []
        for number, path in enumerate(map(Path, paths), 1):
            found, why = self.topo.share(checkpoint.inspect(path, verify=True) if self.layout.rank == 0 else None)
            if found is not None:
                error: str | None = None
                try:
                    if self.restore(found) != found.step:
                        error = f"it holds step {self.last_saved} where its manifest says {found.step}"
                except Exception as exc:  # anything that stops this one loading: try the one before
                    error = str(exc).removeprefix(f"cannot load checkpoint {path}: ")
                every: list[str | None] = [error]  # what failed on each rank
                if self.topo.distributed:
                    every = [None] * self.layout.world_size
                    dist.all_gather_object(every, error, group=self.topo.transport.control)
                failed = [e for e in every if e]
                if not failed:
                    return found
                why = failed[0]
            refused.append(f"{path.name}: {why}")
            if self.layout.rank == 0 and number < len(paths):  # the last: the refusal of the resume says it
                print(f"[gpipe] {checkpoint.refusal(path, why)}", file=sys.stderr, flush=True)
        self.last_saved = -1
        raise no_usable(location, refused)


def _precision(folder: Path) -> str | None:
    """The train.precision a checkpoint was trained with, as the recipe.yaml it keeps says (None: it keeps none)."""
    if not (folder / RECIPE).is_file():  # an older version's checkpoint
        return None
    try:
        recipe = parse_document(read_recipe_file(folder / RECIPE), str(folder / RECIPE))
    except (OSError, UserError):
        return None
    train = recipe.get("train") if isinstance(recipe, dict) else None
    return str(train.get("precision", "fp32")) if isinstance(train, dict) else "fp32"


def skipped_until(run_dir: Path, step: int) -> tuple[int, int]:
    """The steps up to `step` its metrics.jsonl records as skipped: in a row up to `step`, and in all."""
    skipped: dict[int, bool] = {}
    for line in _lines(run_dir / METRICS):
        if _within(line, 1, step):
            record = json.loads(line)
            if record.get("kind") == "train":
                skipped[record["step"]] = bool(record.get("skipped"))
    in_a_row = 0
    while skipped.get(step - in_a_row):
        in_a_row += 1
    return in_a_row, sum(skipped.values())


def trim_metrics(path: Path, step: int) -> None:
    """Drop records after `step` from metrics.jsonl (written after the checkpoint a run resumes from)."""
    if path.exists():
        atomic_write_bytes(path, _text(line for line in _lines(path) if _within(line, 0, step)))


def rewind(run_dir: Path, fork: int, step: int, course: Path | None, when: str) -> Path | None:
    """Set the checkpoints after `fork` aside and rewind metrics.jsonl to `step`; where they went (None: nowhere)."""
    # The newer checkpoints go first: should that fail, the records of their steps are still there.
    aside = checkpoint.set_aside_newer(run_dir, fork, when)
    try:
        rewind_metrics(run_dir, fork, step, aside, course)
    except OSError as exc:  # a full disk: the run is left as it was, for this resume again
        if aside is not None:
            checkpoint.put_back(aside)
        raise UserError(f"cannot rewrite {path_line(run_dir / METRICS)} for the resume from step {step} "
                        f"({exc.strerror or exc}); {space_left(run_dir)}; the run is as it was: once the file can "
                        "be written, resume again") from None
    return aside


def rewind_metrics(run_dir: Path, fork: int, step: int, aside: Path | None, course: Path | None) -> None:
    """metrics.jsonl of a run resumed at `step`: its records after `fork` go to `aside` with the checkpoints set
    aside, and those up to `step` of the course set aside in `course` (a resume from there) come back."""
    path = run_dir / METRICS
    lines = _lines(path)
    later = [line for line in lines if _within(line, fork + 1)]
    if aside is not None and later:  # kept beside the checkpoints of their course, for a resume of it
        atomic_write_bytes(aside / METRICS, _text(later))
    back = [line for line in _lines(course / METRICS) if _within(line, fork + 1, step)] if course else []
    kept = _text([line for line in lines if _within(line, 0, fork)] + back)
    # Left as it is otherwise: a resume needs no space on the disk for it. Compared as bytes: a file whose last
    # line lacks its newline (a kill as it was written) would have the next record appended onto that line.
    if kept != (path.read_bytes() if path.exists() else b""):
        atomic_write_bytes(path, kept)


def _lines(path: Path) -> list[str]:
    """A metrics file's lines ([] when there is none)."""
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def _text(lines: Iterable[str]) -> bytes:
    """Lines as a metrics file holds them."""
    return "".join(line + "\n" for line in lines).encode()


def _within(line: str, first: int, last: int | None = None) -> bool:
    """Whether a metrics line is a whole record of a step from `first` to `last` (not a line torn by a kill)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    recorded = record.get("step", 0) if isinstance(record, dict) else None
    return isinstance(recorded, int) and not isinstance(recorded, bool) and first <= recorded \
        and (last is None or recorded <= last)
