"""`gpipe export`: the consolidated model of a run's checkpoint as one safetensors file."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gpipe_cli.errors import UserError, shown
from gpipe_cli.files import new_file_mode
from gpipe_cli.launch import check_writable
from gpipe_cli.train import checkpoint
from gpipe_cli.train.safe_dcp import SafeLoadPlanner, SafeReader

_MODEL = "model."


def export(location: str, output: str | None = None) -> Path:
    """Write the model weights of the newest verified checkpoint at `location` to a safetensors file."""
    from safetensors.torch import save_file

    if output:
        if os.path.isdir(output):  # found now, not after the checkpoint has been read
            raise UserError(f"--output: {shown(output)} is a directory; give the safetensors file to write")
        check_writable(Path(output).parent, "--output")
    _check_location(location)
    found, refused = checkpoint.newest_whole(Path(location), verify=True)
    for message in refused:
        print(f"[gpipe] {message}", file=sys.stderr)
    if found is None:
        raise UserError(f"{location}: no complete checkpoint to export")
    reader = SafeReader(str(found.path))
    entries = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in entries.items()
             if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
    with checkpoint.single_process_quiet(False):
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    tensors = {key[len(_MODEL):]: value.contiguous() for key, value in state.items()}
    target = Path(output) if output else checkpoint.run_dir_of(found.path) / "model.safetensors"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise UserError(f"cannot write {shown(str(target))} ({exc.strerror})") from None
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"step": str(found.step), "format": "pt",
                                          "layers": "global layer index . parameter name"})
        os.chmod(tmp, new_file_mode())  # as any new file, not mkstemp's 0o600
        os.replace(tmp, target)
    except OSError as exc:  # a full disk, a read-only file system: say so, leave nothing behind
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {shown(str(target))} ({exc.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _check_location(location: str) -> None:
    """Refuse a RUN argument that is no folder, in words that say what it must be."""
    if not location or not os.path.exists(location):
        raise UserError(f"no such run directory or checkpoint: {shown(location)}")
    if not os.path.isdir(location):
        raise UserError(f"{shown(location)} is a file; give a run directory or one of its checkpoint folders")
