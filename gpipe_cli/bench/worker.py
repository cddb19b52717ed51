"""What each rank of a benchmark job runs: `python -m gpipe_cli.bench.worker JOB.json`."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from gpipe_cli.pipeline import stopping
from gpipe_cli.quick_exit import exit_now


def _stop(signum: int, frame: FrameType | None) -> None:
    os._exit(128 + signum)


def main(argv: list[str]) -> None:
    """Join the job, pin threads, and run it guarded so that one failure stops every rank."""
    # Ctrl-C (forwarded by the launcher) or SIGTERM: a benchmark has nothing to save, so the rank leaves
    # quietly whenever it comes: from before torch is imported (which takes seconds), and within the grace
    # period while its main thread waits inside torch.
    try:
        stopping.until_started(announce=False)
        import torch

        from gpipe_cli.bench.setup import Job, run_job
        from gpipe_cli.errors import UserError
        from gpipe_cli.pipeline import failure, topology

        for sig in (signal.SIGINT, signal.SIGTERM):  # imported: now leave at once, unwinding nothing
            signal.signal(sig, _stop)
        try:
            text = Path(argv[0]).read_text()
        except FileNotFoundError:  # the launcher was stopped and cleaned up before this rank read its job
            sys.stdout.flush()
            os._exit(128 + signal.SIGTERM)
        job = Job(**json.loads(text))
        torch.set_num_threads(int(os.environ.get("GPIPE_THREADS", "1")))
        topo = topology.init(job.stages)
        label = f"bench stage {topo.layout.stage} (rank {topo.layout.rank})"
        watch = failure.AbortWatch(label)
        failure.run_guarded(lambda: run_job(job, topo), label, watch, quiet=(UserError,))
        watch.stop()
        # Skip process-group teardown: every figure is written, and gloo's shutdown can stall.
        exit_now(0)
    except stopping.StoppedEarly as stop:
        sys.stdout.flush()
        os._exit(128 + stop.signum)


if __name__ == "__main__":
    main(sys.argv[1:])
