"""Checks made before any rank starts, so that a job that cannot run is one line, not a failing rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gpipe_cli.errors import UserError, shown
from gpipe_cli.limits import MAX_THREADS, outside

if TYPE_CHECKING:  # the launcher imports this module
    from gpipe_cli.launch.launcher import LaunchOptions


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


def check_launch(options: LaunchOptions, world: int) -> int:
    """Check the launch arguments against a job of `world` ranks; returns the ranks on this node."""
    if options.threads is not None and not 1 <= options.threads <= MAX_THREADS:
        raise UserError(outside("--threads", options.threads, 1, MAX_THREADS) or "")
    _, max_nodes = parse_nodes(options.nnodes)
    if world % max_nodes:
        raise UserError(f"the job needs {world} processes, which does not divide over {max_nodes} nodes")
    if options.node_rank is not None and not 0 <= options.node_rank < max_nodes:
        raise UserError(f"--node-rank: must be >= 0 and < the number of nodes, {max_nodes} (got {options.node_rank})")
    if options.rdzv_backend not in (None, "static", "c10d"):
        raise UserError(f"--rdzv-backend: must be static or c10d (got {shown(options.rdzv_backend)})")
    if options.rdzv_endpoint is not None:
        host, sep, port = options.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--rdzv-endpoint: must be HOST:PORT with a port from 1 to 65535 "
                            f"(got {shown(options.rdzv_endpoint)})")
    elif max_nodes > 1:
        raise UserError("a multi-node job needs --rdzv-endpoint HOST:PORT (the same on every node)")
    return world // max_nodes


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
