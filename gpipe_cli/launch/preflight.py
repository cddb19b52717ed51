"""Checks made before any rank starts, so that a job that cannot run is one line, not a failing rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gpipe_cli.errors import UserError, shown


def parse_nodes(nnodes: str) -> tuple[int, int]:
    """`--nnodes N` or `MIN:MAX` as (MIN, MAX)."""
    try:
        low, _, high = nnodes.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise UserError(f"--nnodes must be N or MIN:MAX (got {shown(nnodes)})") from None
    if not 0 < lo <= hi <= 1 << 16:
        raise UserError(f"--nnodes must satisfy 0 < MIN <= MAX <= 65536 (got {shown(nnodes)})")
    return lo, hi


def check_threads(threads: int | None) -> None:
    """`--threads` is a positive count (None: chosen from the cores)."""
    if threads is not None and threads < 1:
        raise UserError(f"--threads: must be >= 1 (got {threads})")


def check_device(backend: str, device: str, local_ranks: int) -> None:
    """Refuse a backend or device this machine cannot run (nccl or cuda without a GPU, nccl on shared GPUs)."""
    if backend != "nccl" and device != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        key = "pipeline.backend: nccl" if backend == "nccl" else "train.device: cuda"
        raise UserError(f"{key} needs a CUDA GPU and this machine has none visible; use "
                        f"{'backend gloo or auto' if backend == 'nccl' else 'device cpu or auto'}")
    if backend == "nccl" and local_ranks > gpus:
        raise UserError(f"pipeline.backend: nccl needs one GPU per rank, but {local_ranks} ranks on this node "
                        f"share {gpus} GPU(s); use backend gloo or auto")


def check_writable(path: Path, what: str) -> None:
    """Refuse an output directory that cannot be created or written, without leaving anything behind."""
    existing = path
    while not os.path.exists(existing) and existing != existing.parent:  # os.path: no errors on long names
        if os.path.islink(existing):  # a dangling link: mkdir would fail later
            raise UserError(f"{what}: {shown(str(existing))} is a broken link")
        existing = existing.parent
    if not os.path.isdir(existing):
        raise UserError(f"{what}: {shown(str(existing))} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what}: {shown(str(existing))} is not writable")
    try:  # access() says yes to root on a read-only file system's permission bits: try it for real
        with tempfile.TemporaryFile(dir=existing, prefix=".gpipe-probe-"):
            pass
    except OSError as exc:
        raise UserError(f"{what}: cannot write to {shown(str(existing))} ({exc.strerror})") from None
