"""Run a function on several real ranks (gloo, CPU), as torchrun would, and collect what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankOutcome:
    """What one rank returned (or its exit code) and what it printed."""

    rank: int
    exitcode: int | None
    result: Any
    output: str


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, folder: str, args: tuple,
           env: dict[str, str]) -> None:
    # A forked rank starts with the server's environment, not the caller's: take the caller's (a test's
    # monkeypatched variable must reach its ranks, as it did with a fresh interpreter per rank).
    os.environ.clear()
    os.environ.update(env)
    log = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    # The job's store is the caller's, as torchrun's agent holds it: a rank that ends first takes no store with it.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    import torch

    torch.set_num_threads(1)
    result = fn(*args)
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip process-group teardown races at exit; the result is already written


# Ranks fork from one server that imported these once: a fresh interpreter per rank would import torch
# again each time (seconds per rank, the bulk of a small multi-rank test). The server itself never runs
# torch work, so no thread pool is forked. torch._dynamo: a rank's first optimizer imports it (seconds more).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "gpipe_cli.pipeline.engine", "gpipe_cli.models",
           "tests.multiproc"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[RankOutcome]:
    """Start `world` processes running fn(*args) with torchrun's environment; wait for all."""
    import torch.distributed as dist

    ctx = _context()
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        # Held here until the ranks end, as torchrun's agent holds the job's store.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)  # noqa: F841
        env = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, folder, args, env)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r, p in enumerate(procs):
            path = Path(folder, f"rank{r}.pkl")
            result = pickle.loads(path.read_bytes()) if path.exists() else None
            log = Path(folder, f"rank{r}.log")
            outcomes.append(RankOutcome(r, p.exitcode, result, log.read_text() if log.exists() else ""))
        return outcomes


def results(outcomes: list[RankOutcome]) -> list[Any]:
    """The results of a run in which every rank must have succeeded (else fail with their output)."""
    bad = [o for o in outcomes if o.exitcode != 0]
    if bad:
        details = "\n".join(f"--- rank {o.rank} (exit {o.exitcode}) ---\n{o.output[-3000:]}" for o in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{details}")
    return [o.result for o in outcomes]
