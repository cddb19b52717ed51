"""Entry point of every training rank: `python -m gpipe_cli.train.worker JOB.json` (started by the launcher)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from gpipe_cli.errors import UserError
from gpipe_cli.pipeline import failure, topology
from gpipe_cli.pipeline.heartbeat import Heartbeat
from gpipe_cli.quick_exit import exit_now
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.train.job import Job
from gpipe_cli.train.loop import Trainer, configure_threads


def run_job(job: Job) -> int:
    """Join the job as this rank and train; any failure stops every rank with its message.

    Returns 0, 128 + the signal that stopped the run early (after its checkpoint), or the non-finite
    exit code (a loss or gradient was not finite; nothing of it was saved).
    """
    configure_threads()
    recipe = Recipe.model_validate(job.recipe)
    pipe = recipe.pipeline
    topo = topology.init(pipe.partitions, pipe.data_parallel, backend=pipe.backend, device=recipe.train.device)
    label = f"stage {topo.layout.stage} (rank {topo.layout.rank})"
    watch = failure.AbortWatch(label) if topo.distributed else None
    stages = topo.layout.stages
    beat = (Heartbeat(watch, topo.layout.rank, topo.layout.world_size, recipe.train.stall_timeout,
                      lambda r: f"rank {r} (stage {r % stages})") if watch is not None else None)

    def train() -> int:
        code = Trainer(recipe, job, topo).run()
        if topo.distributed:  # inside the guard: a peer that fails now still stops this rank cleanly
            dist.barrier(group=topo.transport.control)
        return code

    code = failure.run_guarded(train, label, watch, quiet=(UserError,))
    if beat is not None:
        beat.stop()
    if watch is not None:
        watch.stop()
    if topo.distributed:
        dist.destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> None:
    """Read the job file named on the command line and run it."""
    args = sys.argv[1:] if argv is None else argv
    job = Job(**json.loads(Path(args[0]).read_text()))
    exit_now(run_job(job))


if __name__ == "__main__":
    main()
