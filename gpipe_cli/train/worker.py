"""One training rank: `python -m gpipe_cli.train.worker JOB.json` (from the launcher), or `run_job` under torchrun."""

from __future__ import annotations

import gc
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# No torch on import: the stop handler goes in first, so a Ctrl-C while a rank imports or sets up ends it quietly.
from gpipe_cli.pipeline import stopping
from gpipe_cli.quick_exit import exit_now
from gpipe_cli.train import output

STARTED = "training"  # beside the job file: created once a rank of this node has a step to finish


@dataclass
class Job:
    """A training job, what the launcher hands every rank: the resolved recipe and where and how to run it."""

    recipe: dict[str, Any]
    output_dir: str | None = None
    plain: bool | None = None
    resume: str | None = None  # a run directory or checkpoint to continue from
    started: float | None = None  # time.time() when the command started, for elapsed times on screen
    available: float | None = None  # memory free when the plan was checked: the ranks cut for the same
    run_dir: str | None = None  # a new run's directory, made (and held) by the launcher for it


def main(argv: list[str] | None = None) -> None:
    """Read the job file named on the command line and run it."""
    path = Path((sys.argv[1:] if argv is None else argv)[0])
    try:
        stopping.until_started(announce=False)  # through the imports; the launcher tells a stop in set-up
        code = run_job(Job(**json.loads(path.read_text())), path.parent / STARTED, announce=False)
    except stopping.StoppedEarly as stop:
        code = 128 + stop.signum
    exit_now(code)


# `started` is created once this rank's first step is done (a stop then saves one); `announce`: rank 0 says at once
# that a Ctrl-C during set-up stops it (else its launcher does).
def run_job(job: Job, started: Path | None = None, announce: bool = True) -> int:
    """Join the job as this rank and train, returning the exit code; any failure stops every rank with its message."""
    try:
        stopping.until_started(announce=announce and os.environ.get("RANK", "0") == "0", marker=started)
        output.guard_output(output.stop_run)
        return _run(job)
    except stopping.StoppedEarly as stop:
        return 128 + stop.signum


def _run(job: Job) -> int:
    with stopping.deferred():  # torch's import calls back into Python from C++, where a raise aborts the rank
        import torch
        import torch.distributed as dist

        from gpipe_cli.data.rng import rng
        from gpipe_cli.errors import UserError
        from gpipe_cli.pipeline import failure, topology
        from gpipe_cli.pipeline.heartbeat import Heartbeat
        from gpipe_cli.recipe.schema import Recipe
        from gpipe_cli.recipe_model import pipeline_config
        from gpipe_cli.train.loop import Trainer

    if int(os.environ.get("GPIPE_THREADS", "0")) > 0:  # the intra-op threads the launcher chose for this rank
        torch.set_num_threads(int(os.environ["GPIPE_THREADS"]))
    recipe = Recipe.model_validate(job.recipe)
    pipe = recipe.pipeline
    placed = pipeline_config(recipe)
    # A job over several nodes watches for failures from the start: a node stopped while its ranks connect left
    # the others' ranks waiting for them inside torch, silent, for the connection timeout.
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    early = (failure.AbortWatch(f"stage {rank % pipe.partitions} (rank {rank})")
             if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)) else None)
    if early is not None:
        told = stopping.on_abrupt_exit(lambda: early.stopped() if stopping.ending() else None)
    try:
        topo = topology.init(pipe.partitions, pipe.data_parallel, backend=pipe.backend, device=recipe.train.device,
                             timeout=topology.transport_timeout(recipe.train.stall_timeout), virtual=placed.virtual,
                             placement=placed.placement)
    except stopping.StoppedEarly:
        if early is not None:
            early.stopped()
        raise
    except ValueError as exc:  # e.g. nodes started with different --nnodes: a job of another size formed
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node
            print(f"error: {exc}; start every node of the job with the same --nnodes and recipe", file=sys.stderr,
                  flush=True)
        # At once: the launcher's SIGTERM to the other ranks may land here in an exit handler, as a traceback.
        stopping.abrupt_exit(UserError.exit_code)
    if early is not None:
        told()  # set up: a stop from now on is reported as any other
    label = f"stage {topo.layout.stage} (rank {topo.layout.rank})"
    watch = early or (failure.AbortWatch(label) if topo.distributed else None)
    stages = topo.layout.stages
    beat = (Heartbeat(watch, topo.layout.rank, topo.layout.world_size, recipe.train.stall_timeout,
                      lambda r: f"rank {r} (stage {r % stages})") if watch is not None else None)

    # A failure ends this process at once (`stopping.abrupt_exit`), which first lets go of the run's claim: under
    # torchrun rank 0 holds it.
    def train() -> int:
        if topo.distributed:
            check_same_recipe(job.recipe, topo, job.resume is not None)
        # Nothing draws from torch's own generator (dropout, data and weights have theirs), but a checkpoint keeps
        # its state: seeded, two runs of one recipe write the same bytes.
        torch.manual_seed(int(rng(recipe.seed, "torch", topo.layout.rank).integers(2**63)))
        trainer = Trainer(recipe, job, topo)
        # What set-up made lives for the run: the collector's full passes, which paused a step for ~0.1 s each,
        # no longer walk it.
        gc.freeze()
        try:
            code = trainer.run()
        except BaseException:  # a stop before the first step, a failure: the live view ends first, cursor shown
            if trainer.view is not None:
                trainer.view.stop()
            raise
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


# Paths may differ from node to node (each its own copy of the data); anything else trained differently would fail
# in a collective of unequal sizes (gloo aborts the process) or part replicas without a word.
_PER_NODE = ("data.path", "data.tokenizer")


def check_same_recipe(recipe: dict[str, Any], topo: Any, resuming: bool = False) -> None:
    """Refuse, on every rank, a job whose ranks were handed different recipes or resumes (nodes started apart)."""
    from gpipe_cli.errors import UserError

    every = topo.fabric.gather_objects((recipe, resuming))  # rank 0 compares
    problem = topo.share(_resumes_apart(every, resuming) or _recipes_apart(every, recipe) if every else None)
    if problem:
        raise UserError(problem)


def _resumes_apart(every: list[tuple[dict[str, Any], bool]], resuming: bool) -> str | None:
    """Which rank resumes where rank 0 does not, or the reverse, in words (None: all alike)."""
    # A node resuming beside one starting afresh left rank 0 reading its checkpoint for peers that never would.
    apart = next((rank for rank, (_, theirs) in enumerate(every) if theirs != resuming), None)
    if apart is None:
        return None
    return (f"rank 0 {'resumes' if resuming else 'starts a new run'} and rank {apart} "
            f"{'starts a new run' if resuming else 'resumes'}: start every node of the job with --resume, or none")


def _recipes_apart(every: list[tuple[dict[str, Any], bool]], recipe: dict[str, Any]) -> str | None:
    """The first key a rank's recipe differs in from rank 0's, in words (None: all alike but per-node paths)."""
    from gpipe_cli.train.existing import differences

    for rank, (theirs, _) in enumerate(every):
        differ = sorted((c for c in differences(recipe, theirs, "") if c.key not in _PER_NODE), key=lambda c: c.key)
        if differ:
            first = differ[0]
            others = f" (and {len(differ) - 1} more key{'s' * (len(differ) > 2)})" if len(differ) > 1 else ""
            return (f"the nodes were given different recipes: {first.key} is {json.dumps(first.new, default=str)} "
                    f"on rank {rank} and {json.dumps(first.old, default=str)} on rank 0{others}; start every node "
                    "with the same recipe and --set values")
    return None


if __name__ == "__main__":
    main()
