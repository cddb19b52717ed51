"""Checkpoints: whole or absent, keyed by global layer names, so a run can resume with another K."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gpipe_cli.errors import UserError, path_line
from gpipe_cli.files import atomic_write_bytes, space_left
from gpipe_cli.pipeline import heartbeat
from gpipe_cli.pipeline.failure import ANNOUNCED
from gpipe_cli.runs import CHECKPOINTS, MANIFEST, METRICS, PREFIX, SUPERSEDED, candidates
from gpipe_cli.train.existing import way_on
from gpipe_cli.train.safe_dcp import SafeLoadPlanner, SafeReader, UnsafeCheckpoint

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # one key per parameter: reshardable
CHECKSUM = "xxh3_64"
_CHUNK = 1 << 22
# Tests make a checkpoint write fail as a full disk would: "enospc@STEP" (honoured only when set).
FAULT_ENV = "GPIPE_TEST_CHECKPOINT_FAULT"


class CheckpointWriteError(UserError):
    """A checkpoint could not be written; its partial folder is gone and the run stops."""

    exit_code = ANNOUNCED  # told in one line by the rank that hit it: the launcher adds nothing


def path_for(run_dir: Path, step: int) -> Path:
    """Where the checkpoint after `step` optimizer steps lives."""
    return run_dir / CHECKPOINTS / f"{PREFIX}{step:08d}"


def partial_for(path: Path) -> Path:
    """The hidden folder a checkpoint is written into before it is renamed into place."""
    return path.parent / f".{path.name}.partial"


def remove_partials(run_dir: Path) -> list[Path]:
    """Remove the hidden folders of unfinished saves and return them; from one process, before any rank saves."""
    stale = sorted((run_dir / CHECKPOINTS).glob(f".{PREFIX}*.partial"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def set_aside_newer(run_dir: Path, step: int, when: str) -> Path | None:
    """Move the checkpoints after `step` (another course of the run, or damaged) out of the resume's way."""
    # A run resumed from an earlier checkpoint trains anew from there: left in place, a newer one from the
    # course it leaves would be what the next --resume continues. Moved, not removed: they may be worth keeping.
    newer = [p for p in candidates(run_dir / CHECKPOINTS) if _number(p) > step]
    if not newer:
        return None
    base = run_dir / CHECKPOINTS / f"{SUPERSEDED}{when}-at-step-{step}"
    for n in itertools.count():  # a folder of its own, even for two resumes in one second
        aside = base.with_name(f"{base.name}-{n}") if n else base
        with contextlib.suppress(FileExistsError):
            aside.mkdir()
            break
    for path in newer:
        path.rename(aside / path.name)
    return aside


def put_back(aside: Path) -> None:
    """Undo `set_aside_newer`: its checkpoints back where they were, its folder gone."""
    for path in aside.iterdir():
        if path.name.startswith(PREFIX):
            path.rename(aside.parent / path.name)
    with contextlib.suppress(OSError):  # it holds the records of their steps only once they were written
        (aside / METRICS).unlink(missing_ok=True)
        aside.rmdir()


def _number(path: Path) -> int:
    """The step in a checkpoint folder's name (-1 for a name that holds none)."""
    digits = path.name.removeprefix(PREFIX)
    return int(digits) if digits.isdigit() else -1


@dataclass(frozen=True)
class Found:
    """A checkpoint on disk and what its manifest says."""

    path: Path
    step: int
    manifest: dict[str, Any]


def checksum(path: Path) -> str:
    """The checksum a manifest records for a file."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def inspect(path: Path, verify: bool = False) -> tuple[Found | None, str | None]:
    """A checkpoint folder and its manifest when it is whole (`verify`: every file's checksum too), or why not."""
    if not path.is_dir():
        return None, "it does not exist"
    if not (path / MANIFEST).exists():
        return None, "it has no manifest (the save did not finish)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, sums, step = manifest["files"], manifest.get("checksums", {}), manifest["step"]
        valid = (isinstance(files, dict) and isinstance(sums, dict)
                 and all(isinstance(v, int) and not isinstance(v, bool) for v in files.values())
                 and all(isinstance(v, str) for v in sums.values()))
    except (OSError, ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        return None, "its manifest is unreadable"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None, f"its manifest gives step {str(step)[:40]!r}, which is not a step count"
    for name, size in files.items():
        target = path / name
        if os.sep in name or name in ("", ".", "..") or not target.is_file():
            return None, f"file {name} is missing"
        if target.stat().st_size != size:
            return None, f"file {name} has {target.stat().st_size} bytes where {size} were written"
    for name, expected in sums.items() if verify else ():
        if name not in files:
            return None, f"file {name} is missing"
        try:
            same = checksum(path / name) == expected
        except OSError as exc:  # no permission, a failing disk: this checkpoint cannot be used, an older one may
            return None, f"file {name} cannot be read ({exc.strerror or exc})"
        if not same:
            return None, f"file {name} does not match its checksum (the data changed after it was written)"
    return Found(path, step, manifest), None


def newest_whole(location: Path, verify: bool = False) -> tuple[Found | None, list[str]]:
    """The newest usable checkpoint at `location`, and a message for each newer one that was refused."""
    refused: list[str] = []
    for path in candidates(location):
        found, why = inspect(path, verify)
        if found is not None:
            return found, refused
        refused.append(refusal(path, str(why)))
    return None, refused


OTHER_MODEL = "it was written for another model, or by a gpipe that built this model's layers otherwise"


def refusal(path: Path, why: str) -> str:
    """The one line that says a checkpoint is skipped."""
    what = "is not of this model" if why.startswith(OTHER_MODEL) else "is incomplete or corrupt"
    return f"checkpoint {path} {what}: {why}; using the one before it"


def state_of(module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]) -> dict[str, Any]:
    """What one rank puts in a checkpoint: its parameters and buffers, optimizer state, training state."""
    state: dict[str, Any] = {"model": module.state_dict(), **extra}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    return state


@contextlib.contextmanager
def single_process_quiet(distributed: bool) -> Iterator[None]:
    """Hide DCP's warning that it runs without a process group (a one-stage run is meant to)."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _cause(exc: BaseException) -> str:
    """The first rank's underlying error, in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else getattr(first, "exc", first)  # DCP wraps each rank's error
    if isinstance(exc, UnsafeCheckpoint):
        return str(exc)
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds an object that is not plain data, and checkpoints are never unpickled beyond that"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    missing = re.match(r"Missing key in checkpoint state_dict: (?:model\.)?(.+?)\.?$", text)
    if missing:  # DCP's words when the model asks for a parameter the checkpoint lacks
        return f"{OTHER_MODEL} (parameter {missing.group(1)} is missing)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def save(path: Path, state: dict[str, Any], manifest: dict[str, Any], keep: int, rank: int,
         group: dist.ProcessGroup | None, extra: Mapping[str, bytes] | None = None) -> None:
    """Write a checkpoint collectively, at `path` once all parts are on disk (CheckpointWriteError where it fails);
    `extra`: more files rank 0 writes into it, checked as the rest."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    partial = partial_for(path)
    with heartbeat.paused():
        try:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
                partial.parent.mkdir(exist_ok=True)  # not the run's folder: gone, it was moved or removed
                partial.mkdir()
            if distributed:
                dist.barrier(group=group)
            with single_process_quiet(distributed):
                dcp.save(state, storage_writer=_writer(partial, manifest.get("step")), no_dist=not distributed)
            for name, data in (extra or {}).items() if rank == 0 else ():
                (partial / name).write_bytes(data)  # the folder becomes the checkpoint only whole: no atomic write
            sums = _checksums(partial, rank, group, distributed)
            if rank == 0:
                files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
                body = {**manifest, "files": files, "checksum": CHECKSUM, "checksums": sums}
                atomic_write_bytes(partial / MANIFEST, json.dumps(body, indent=1).encode())
                shutil.rmtree(path, ignore_errors=True)
                partial.rename(path)
        except (OSError, CheckpointException) as exc:
            failure = _write_failure(path, exc)  # the space left as the write found it, before the partial goes
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointWriteError(failure) from None
        if rank == 0:
            prune(path.parent, keep)
        if distributed:
            dist.barrier(group=group)


def _checksums(folder: Path, rank: int, group: dist.ProcessGroup | None, distributed: bool) -> dict[str, str]:
    """Every file's checksum, each rank reading a share of the files (all ranks see the same folder)."""
    if distributed:
        dist.barrier(group=group)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    world = dist.get_world_size(group) if distributed else 1
    mine = {name: checksum(folder / name) for name in names[rank::world]}
    if not distributed:
        return mine
    shares: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(shares, mine, group=group)
    return {name: value for share in shares for name, value in (share or {}).items()}


def prune(folder: Path, keep: int) -> None:
    """Remove checkpoints beyond the newest `keep` whole ones (damaged ones do not count)."""
    whole = 0
    for path in candidates(folder):
        if whole >= keep:
            shutil.rmtree(path, ignore_errors=True)
        elif inspect(path)[1] is None:
            whole += 1


def _write_failure(path: Path, exc: BaseException) -> str:
    """One line: what failed, and how much space is left."""
    run_dir = path.parent.parent
    if not run_dir.is_dir():
        return (f"cannot write checkpoint {path.name}: the run directory {path_line(run_dir)} was moved or removed "
                "while the run trained")
    cause = _os_error(exc)
    what = f"{errno.errorcode.get(cause.errno, '')}: {cause.strerror}" if cause and cause.errno else _cause(exc)
    if cause is None and "unexpected pos" in what:  # how torch's zip writer reports a write that fell short
        what += "; a write fell short, as on a full disk"
    free = space_left(path.parent)
    earlier = "earlier checkpoints are intact" if candidates(path.parent) else "no earlier checkpoint exists"
    return (f"cannot write checkpoint {path.name} ({what}); {free}; removed the partial checkpoint, {earlier}; once "
            f"it can be written, {way_on(run_dir)}")


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a (DCP-wrapped) failure, if any."""
    seen: list[BaseException] = [exc]
    while seen:
        current = seen.pop()
        if isinstance(current, OSError):
            return current
        for failure in (getattr(current, "failures", None) or {}).values():
            seen.append(failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure))
        if current.__cause__ is not None:
            seen.append(current.__cause__)
    return None


def _writer(folder: Path, step: object) -> dcp.FileSystemWriter:
    """DCP's file writer (one that fails as a full disk does when a test asks for it at this step)."""
    fault = os.environ.get(FAULT_ENV, "")
    if fault == f"enospc@{step}":
        return _FullDiskWriter(str(folder))
    return dcp.FileSystemWriter(str(folder))


class _FullDiskWriter(dcp.FileSystemWriter):
    """Writes its files, then fails as a full disk does: the partial folder is real."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        result = super().write_data(*args, **kwargs)
        result.wait()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def tied_sources(keys: Iterable[str], saved: set[str], tied: Sequence[Sequence[str]]) -> dict[str, str]:
    """Each optimizer key of a tied copy that a checkpoint lacks, to the same key of a copy it holds."""
    # Where one stage held every copy they were one tensor, whose state torch saves under the first name only; the
    # copies on other stages hold the same values (their gradients summed, their updates alike).
    out = {}
    for key in keys:
        if f"optim.{key}" in saved:
            continue
        for group, part in itertools.product(tied, ("state.", "param_groups.")):
            name = next((n for n in group if key.startswith(f"{part}{n}.")), None)
            if name is not None:
                rest = key.removeprefix(f"{part}{name}.")
                held = [f"{part}{other}.{rest}" for other in group if f"optim.{part}{other}.{rest}" in saved]
                if held:
                    out[key] = held[0]
                break
    return out


def load(found: Found, module: nn.Module, optimizer: torch.optim.Optimizer | None,
         extra: dict[str, Any], tied: Sequence[Sequence[str]] = ()) -> dict[str, Any]:
    """Load this rank's part of a checkpoint into the module and optimizer; return the `extra` items."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    state = state_of(module, optimizer, extra)
    try:
        # Read the metadata first: DCP logs a failure to read it, with a traceback, before it raises.
        saved = set(SafeReader(str(found.path)).read_metadata().state_dict_metadata)
        moved = tied_sources(list(state["optim"]), saved, tied) if optimizer is not None else {}
        for key, held in moved.items():
            state["optim"][held] = state["optim"].pop(key)
        with single_process_quiet(distributed), root_log_quiet():
            dcp.load(state, storage_reader=SafeReader(str(found.path)), planner=SafeLoadPlanner(),
                     no_dist=not distributed)
        for key, held in moved.items():
            state["optim"][key] = state["optim"].pop(held)
        module.load_state_dict(state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(module, optimizer, state["optim"], options=_OPTIONS)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise UserError(f"cannot load checkpoint {found.path}: {_cause(exc)}") from None
    return {key: state[key] for key in extra}


@contextlib.contextmanager
def root_log_quiet() -> Iterator[None]:
    """DCP's loader logs through the root logger; its failures become one line of ours instead."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        root.setLevel(level)
