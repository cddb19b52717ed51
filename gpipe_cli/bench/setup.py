"""How a benchmark is set up and started: its jobs, their balance, whether their ranks fit the hardware, and
launching them to read back what rank 0 wrote."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from gpipe_cli.bench.job import Job
from gpipe_cli.bench.options import SWEEP_PARTITIONS, BenchOptions, parse_balance
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.estimate.subject import Subject
from gpipe_cli.launch.launcher import LaunchOptions, launch
from gpipe_cli.models.describe import count_parameters
from gpipe_cli.pipeline import placement, schedules
from gpipe_cli.sizing import usable_cores

WORKER = "gpipe_cli.bench.worker"


class JobFailed(RuntimeError):
    """A benchmark job whose ranks did not all finish; the failing rank has printed why."""

    def __init__(self, code: int, partial: dict[str, Any]) -> None:
        super().__init__(f"benchmark ranks exited with code {code}")
        self.code, self.partial = code, partial


def launch_job(job: Job, folder: Path, name: str, threads: int) -> dict[str, Any]:
    """Run `job` on `job.stages` ranks; rank 0's figures (raises JobFailed with what was written)."""
    out, path = folder / f"{name}.out.json", folder / f"{name}.job.json"
    job = replace(job, out=str(out))
    path.write_text(json.dumps(asdict(job)))
    code = launch(WORKER, [str(path)], job.stages, LaunchOptions(threads=threads))
    result = json.loads(out.read_text()) if out.exists() else {}
    if code != 0:
        raise JobFailed(code, result)
    return result


def oversubscription(ranks: int, threads: int) -> tuple[bool, str]:
    """Whether `ranks` ranks share cores or GPUs, and what they run on."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return ranks > gpus, f"{gpus} GPU{'s' if gpus != 1 else ''}"
    cores = usable_cores()
    return ranks * threads > cores, f"{cores} CPU core{'s' if cores != 1 else ''}"


def sweep_partitions(options: BenchOptions, layers: int) -> list[int]:
    """The K of `--sweep` that this machine hosts (any with --oversubscribe; none at all: the least K, flagged)."""
    ks = [k for k in SWEEP_PARTITIONS
          if k <= layers and (options.oversubscribe or not oversubscription(k, options.threads)[0])]
    return ks or [k for k in SWEEP_PARTITIONS[:1] if k <= layers]


def base_job(options: BenchOptions, subject: Subject, stages: int, balance: list[int], **fields: Any) -> Job:
    """A job with the options' model, batch, schedule and step counts (`fields`: the job's other fields)."""
    job = Job(subject=subject.to_json(), stages=stages, balance=balance, batch_size=options.batch,
              microbatches=options.microbatch_values(), schedule=options.schedule, checkpoint=options.checkpoint,
              steps=options.steps, warmup=options.warmup, seed=options.seed, out="", offload=options.offload)
    return replace(job, **fields)


def choose_balance(options: BenchOptions, costs: CostProfile, stages: int) -> tuple[list[int], str]:
    """The explicit balance, or the split of the measured per-layer time into K x V chunks whose busiest stage is
    least (the runner's `check_cut` has refused a cut the model cannot take)."""
    explicit = parse_balance(options.balance, options.chunk_count(stages))
    if explicit is not None:
        return explicit, "explicit"
    owners = placement.cut_owners(stages, options.virtual_stages, schedules.get(options.schedule).placement)
    balance = costs.balance(options.chunk_count(stages), options.checkpoint, owners, max(options.microbatch_values()))
    return balance, "measured time"


def model_json(subject: Subject) -> dict[str, Any]:
    """What the JSON says about the model."""
    spec = subject.build()
    return {**subject.to_json(), "name": spec.name, "task": spec.task, "layers": len(spec.layers),
            "parameters": count_parameters(spec)}
