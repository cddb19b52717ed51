"""`gpipe train` run as under torchrun, each rank forked from the suite's preloaded server: no torch import per rank."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.multiproc import PRELOAD, free_port


@dataclass
class Ranks:
    """How `gpipe train` ended on each rank, and what they all printed (a launcher passes on every rank's output)."""

    codes: list[int | None]
    stdout: str
    stderr: str


def _rank(args: list[str], rank: int, world: int, port: int, folder: str, env: dict[str, str]) -> None:
    # The caller's environment (the session's cache of layer costs), then torchrun's for this rank.
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    for fd, name in ((1, "out"), (2, "err")):  # stdout and stderr apart, as the tests read them
        os.dup2(os.open(os.path.join(folder, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    import torch

    torch.set_num_threads(1)  # as the launcher's --threads 1: the same sums in the same order
    from gpipe_cli.cli import run

    try:
        code = run(["train", *args, "--plain"])
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 1
    with open(os.path.join(folder, f"{rank}.code"), "wb") as f:
        pickle.dump(code, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the exit code is written; skip the process-group teardown at exit


def gpipe_train(world: int, *args: str, env: dict[str, str] | None = None, timeout: float = 300.0) -> Ranks:
    """`gpipe train *args --plain` on `world` ranks (the recipe's K x D) started as torchrun would; wait for all."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # the same server as tests.multiproc's, whichever starts it
    with tempfile.TemporaryDirectory() as folder:
        port, env = free_port(), {**os.environ, **(env or {})}
        procs = [ctx.Process(target=_rank, args=(list(args), r, world, port, folder, env)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes = []
        for r, p in enumerate(procs):
            path = Path(folder, f"{r}.code")
            codes.append(pickle.loads(path.read_bytes()) if p.exitcode == 0 and path.exists() else p.exitcode)
        out, err = ("".join(Path(folder, f"{r}.{name}").read_text() for r in range(world)) for name in ("out", "err"))
        return Ranks(codes, out, err)
