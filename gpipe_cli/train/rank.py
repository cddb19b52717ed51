"""One training rank: join the job, train, and stop every rank with one message if anything fails."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from gpipe_cli.errors import UserError
from gpipe_cli.pipeline import failure, stopping, topology
from gpipe_cli.pipeline.heartbeat import Heartbeat
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe_model import pipeline_config
from gpipe_cli.train.job import Job
from gpipe_cli.train.loop import Trainer, configure_threads


def run_job(job: Job, started: Path | None = None, announce: bool = True) -> int:
    """Join the job as this rank and train; any failure stops every rank with its message.

    Returns 0, 128 + the signal that stopped the run early, or the non-finite exit code. `started` is created
    once this rank's first step is done (a stop then saves one); `announce`: rank 0 says at once that a
    Ctrl-C during set-up stops it (else its launcher does).
    """
    try:
        stopping.until_started(announce=announce and os.environ.get("RANK", "0") == "0", marker=started)
        return _run(job)
    except stopping.StoppedEarly as stop:
        return 128 + stop.signum


def _run(job: Job) -> int:
    configure_threads()
    recipe = Recipe.model_validate(job.recipe)
    pipe = recipe.pipeline
    placed = pipeline_config(recipe)
    topo = topology.init(pipe.partitions, pipe.data_parallel, backend=pipe.backend, device=recipe.train.device,
                         virtual=placed.virtual, placement=placed.placement)
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
