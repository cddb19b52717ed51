"""A rank's program for the forked-launch tests: it records what it finds, then ends as its arguments say."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from gpipe_cli.quick_exit import exit_now


def main(argv: list[str]) -> None:
    """Record this rank's facts in FOLDER/rank-R.json, wait for FOLDER/go, then end as MODE says."""
    folder, mode = Path(argv[0]), argv[1]
    rank = int(os.environ["RANK"])
    facts = {"pid": os.getpid(), "parent": os.getppid(), "session_leader": os.getsid(0) == os.getpid(),
             "torch_before_main": "torch" in sys.modules, "probe_env": os.environ.get("GPIPE_PROBE"),
             "world": int(os.environ["WORLD_SIZE"]), "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
             "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}
    (folder / f"rank-{rank}.json").write_text(json.dumps(facts))
    deadline = time.monotonic() + 60
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank == 1 and mode == "fail":
        print("rank 1 fails on purpose", end="")  # no newline, no flush: the rank's output is unbuffered
        raise SystemExit(5)
    if rank == 1 and mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    exit_now(0)


if __name__ == "__main__":  # where ranks start as `python -m` (no fork server)
    main(sys.argv[1:])


def sleeping_rank(index: int, parent: str) -> None:
    """A rank that takes SIGINT back, as `forked.run` does, says its pid in `parent`/rank.pid, and sleeps."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    (Path(parent) / "rank.pid").write_text(str(os.getpid()))
    time.sleep(120)
