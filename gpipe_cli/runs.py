"""The run directory's layout: the names of its files, and how runs and their checkpoints are found."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

RECIPE = "recipe.yaml"
SUPERSEDED = "superseded-"  # checkpoints/superseded-...: a course a resume from an earlier step left
EXPORTED = "model.safetensors"  # what gpipe export writes into the run directory by default
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
PREFIX = "step-"  # of a checkpoint folder: checkpoints/step-00000100
MANIFEST = "manifest.json"  # written last into a checkpoint folder: a folder with it is a finished save
TOKENIZER_FILE = "tokenizer.model"
CLASSES_FILE = "classes.json"  # an image run's class names in label order, as it trained on them


def run_dir_of(location: str) -> Path:
    """The run directory a --resume location belongs to (a run directory or one of its checkpoints)."""
    path = Path(location)
    # Typed from inside the run (`checkpoints/step-...`) or its checkpoints/ (`step-...`): its run lies above.
    if not (path.name.startswith((PREFIX, SUPERSEDED)) or path.name == CHECKPOINTS):
        return _run_dir(path)
    try:
        found = _run_dir(path)
    except IndexError:  # `superseded-.../step-...`: fewer folders typed than lie between it and its run
        found = path
    return _run_dir(Path(os.path.abspath(location))) if found in (Path("."), path) else found


def _run_dir(path: Path) -> Path:
    if is_checkpoint(path):  # in checkpoints/, or in a folder a resume set it aside into
        return path.parents[2] if path.parent.name.startswith(SUPERSEDED) else path.parent.parent
    if path.name.startswith(SUPERSEDED) and path.parent.name == CHECKPOINTS:  # the newest of a course set aside
        return path.parent.parent
    return path.parent if path.name == CHECKPOINTS else path


def kept_by_a_run(path: Path) -> tuple[Path, str] | None:
    """(run directory, what) when `path` is a file a run keeps or lies in its checkpoints/; else None."""
    # Any command's output named there would replace what a later resume, export or report reads. As named
    # and where links lead: a link to a run's checkpoints/ writes into it all the same.
    try:
        for where in dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))):
            if where.name in (RECIPE, METRICS, TOKENIZER_FILE) and is_run(where.parent):
                return _as_named(where.parent, path), f"is the run's {where.name}: writing there would replace it"
            for folder in (where, *where.parents):
                if folder.name == CHECKPOINTS and is_run(folder.parent):
                    return _as_named(folder.parent, path), f"is inside the run's {CHECKPOINTS}/, which training " \
                        "prunes and resumes from"
    except (OSError, ValueError):  # a name no file system takes: the write says what is wrong with it
        pass
    return None


def is_run(folder: Path) -> bool:
    """Whether `folder` is a run directory: it holds step checkpoints, or metrics.jsonl begins with a record."""
    if candidates(folder / CHECKPOINTS):
        return True
    try:
        with open(folder / METRICS, "rb") as f:
            first = json.loads(f.readline(1 << 20))
    except (OSError, ValueError):  # none, unreadable, or not a record (another command's JSON written there)
        return False
    return isinstance(first, dict) and "kind" in first


def _as_named(folder: Path, path: Path) -> Path:
    """`folder` relative to here when `path` was named so."""
    return folder if path.is_absolute() else Path(os.path.relpath(folder))


def last_step(run_dir: Path) -> int | None:
    """The last step a run directory records: its newest metrics record, else its newest checkpoint."""
    steps: list[int] = []
    with contextlib.suppress(OSError):
        for line in (run_dir / METRICS).read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):  # a torn last line: the run died writing it
                step = json.loads(line).get("step")
                if isinstance(step, int) and not isinstance(step, bool):
                    steps.append(step)
    saved = [int(p.name[len(PREFIX):]) for p in candidates(run_dir / CHECKPOINTS) if p.name[len(PREFIX):].isdigit()]
    return max(steps or saved, default=None)


def holds_run(run_dir: Path) -> bool:
    """Whether a directory holds a run: a metrics record or a checkpoint (an empty or set-up-only one does not)."""
    metrics = run_dir / METRICS
    try:
        recorded = metrics.is_file() and metrics.stat().st_size > 0
    except OSError:
        recorded = False
    return recorded or bool(candidates(run_dir / CHECKPOINTS))


def newest_run_in(folder: Path) -> Path | None:
    """The newest run one or two levels below `folder` (outputs/NAME/STAMP), as `gpipe export outputs` means."""
    try:
        runs = [run for pattern in ("*", "*/*") for run in folder.glob(pattern) if run.is_dir() and holds_run(run)]
        return max(runs, key=_last_trained, default=None)
    except OSError:  # a folder this process cannot read, or a run removed meanwhile: nothing to point to
        return None


def _last_trained(run: Path) -> float:
    """When a run last recorded a step: its records' time, not its folder's, which a report written in it moves."""
    metrics = run / METRICS
    return (metrics if metrics.is_file() else run).stat().st_mtime


def is_checkpoint(path: Path) -> bool:
    """Whether `path` names one checkpoint folder: `step-*`, or one renamed or copied, known by its manifest."""
    return path.name.startswith(PREFIX) or (path / MANIFEST).is_file()


def candidates(location: Path) -> list[Path]:
    """Checkpoint folders at `location` (a run directory, its checkpoints/ or one checkpoint), newest first."""
    if is_checkpoint(location):
        return [location]
    # By step: step-100000000, past eight digits, comes after step-99999999 though it sorts before it as text.
    return sorted((p for p in checkpoint_folders(location)[1] if p.name.startswith(PREFIX)),
                  key=lambda p: (len(p.name), p.name), reverse=True)


def checkpoint_folders(location: Path) -> tuple[Path, list[Path]]:
    """The folder of a run's checkpoints (its checkpoints/, or `location` itself) and the folders in it."""
    folder = location / CHECKPOINTS if (location / CHECKPOINTS).is_dir() else location
    try:
        return folder, [p for p in folder.iterdir() if p.is_dir()]
    except OSError:  # no folder there, or one this process cannot read: no checkpoint it could use
        return folder, []


def newest_step(run_dir: Path) -> int | None:
    """The step of the run's newest finished checkpoint, as its manifest says (None: there is none)."""
    # No checksums: a quick look for `gpipe predict`, which must not load the checkpoint code (torch.distributed).
    for path in candidates(run_dir):
        try:
            step = json.loads((path / MANIFEST).read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError):  # unfinished or unreadable: not one export would use
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None
