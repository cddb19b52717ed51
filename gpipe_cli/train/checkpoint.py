"""Checkpoints: whole or absent, keyed by global layer names, so a run can resume with another K.

Every rank writes its stage through torch.distributed.checkpoint into a hidden folder; rank 0 then
writes a manifest of every file and its size and renames the folder into place, which is atomic. A
checkpoint without a manifest, or whose files do not match it, is refused with a clear message and the
one before it is used. Loading never unpickles arbitrary objects (see safe_dcp.py).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from gpipe_cli.errors import UserError
from gpipe_cli.train.rundir import atomic_write_bytes
from gpipe_cli.train.safe_dcp import SafeLoadPlanner, SafeReader

PREFIX = "step-"
MANIFEST = "manifest.json"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # one key per parameter: reshardable


def run_dir_of(path: Path) -> Path:
    """The run directory a checkpoint folder belongs to."""
    return path.parent.parent


def path_for(run_dir: Path, step: int) -> Path:
    """Where the checkpoint after `step` optimizer steps lives."""
    return run_dir / "checkpoints" / f"{PREFIX}{step:08d}"


@dataclass(frozen=True)
class Found:
    """A checkpoint on disk and what its manifest says."""

    path: Path
    step: int
    manifest: dict[str, Any]


def problem(path: Path) -> str | None:
    """Why a checkpoint folder cannot be used, or None when it is whole."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        return "it does not exist"
    if not manifest_path.exists():
        return "it has no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return "its manifest is unreadable"
    for name, size in files.items():
        target = path / name
        if not target.exists():
            return f"file {name} is missing"
        if target.stat().st_size != size:
            return f"file {name} has {target.stat().st_size} bytes where {size} were written"
    return None


def candidates(location: Path) -> list[Path]:
    """Checkpoint folders at `location` (a run directory, its checkpoints/ or one checkpoint), newest first."""
    if location.name.startswith(PREFIX):
        return [location]
    folder = location / "checkpoints" if (location / "checkpoints").is_dir() else location
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), reverse=True)


def newest_whole(location: Path) -> tuple[Found | None, list[str]]:
    """The newest usable checkpoint at `location`, and a message for each newer one that was refused."""
    refused: list[str] = []
    for path in candidates(location):
        why = problem(path)
        if why is None:
            manifest = json.loads((path / MANIFEST).read_text())
            return Found(path, int(manifest["step"]), manifest), refused
        refused.append(f"checkpoint {path} is incomplete or corrupt: {why}; using the one before it")
    return None, refused


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
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds an object that is not plain data, and checkpoints are never unpickled beyond that"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def save(path: Path, state: dict[str, Any], manifest: dict[str, Any], keep: int, rank: int,
         group: dist.ProcessGroup | None) -> None:
    """Write a checkpoint collectively; it appears at `path` only once every rank's part is on disk."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    partial = path.parent / f".{path.name}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if distributed:
        dist.barrier(group=group)
    with single_process_quiet(distributed):
        dcp.save(state, checkpoint_id=str(partial), no_dist=not distributed)
    if distributed:
        dist.barrier(group=group)
    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
        atomic_write_bytes(partial / MANIFEST, json.dumps({**manifest, "files": files}, indent=1).encode())
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
        for old in candidates(path.parent)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier(group=group)


def load(found: Found, module: nn.Module, optimizer: torch.optim.Optimizer | None,
         extra: dict[str, Any]) -> dict[str, Any]:
    """Load this rank's part of a checkpoint into the module and optimizer; return the `extra` items."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    state = state_of(module, optimizer, extra)
    try:
        with single_process_quiet(distributed):
            dcp.load(state, storage_reader=SafeReader(str(found.path)), planner=SafeLoadPlanner(),
                     no_dist=not distributed)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise UserError(f"cannot load checkpoint {found.path}: {_cause(exc)}") from None
    module.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state["optim"], options=_OPTIONS)
    return {key: state[key] for key in extra}
