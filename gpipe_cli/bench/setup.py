"""How a benchmark is set up and started: its jobs, what each rank measures, and launching them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpipe_cli.bench.options import SWEEP_PARTITIONS, BenchOptions
from gpipe_cli.estimate.costs import profile
from gpipe_cli.estimate.measure import build_pipeline, measure_engine
from gpipe_cli.estimate.subject import Subject, example_batch
from gpipe_cli.files import atomic_write_text
from gpipe_cli.launch.launcher import LaunchOptions, launch
from gpipe_cli.models.describe import count_parameters
from gpipe_cli.pipeline import microbatch, topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.sizing import usable_cores
from gpipe_cli.units import counted

WORKER = "gpipe_cli.bench.worker"


@dataclass
class Job:
    """One launch of K ranks: the model, the cut, what to run and where rank 0 writes the figures."""

    subject: dict[str, Any]
    stages: int
    balance: list[int]
    batch_size: int
    microbatches: list[int]
    schedule: str
    checkpoint: str
    steps: int
    warmup: int
    seed: int
    out: str
    profile_costs: bool = False
    trace: bool = False
    compare: bool = False
    host_overhead: bool = False  # K=1 only: the engine against a plain loop (see `overhead`)
    profile_chunks: int | None = None  # M whose micro-batch the costs are timed on (None: the job's largest M)
    offload: str = "none"


# Rank 0 writes the figures after every phase, so a failure late in the job (a baseline) leaves the earlier ones.
def _save(result: dict[str, Any], out: str) -> None:
    atomic_write_text(Path(out), json.dumps(result))  # readers never see half a file


def run_job(job: Job, topo: topology.Topology) -> None:
    """Measure what the job asks for on this rank."""
    spec = Subject.from_json(job.subject).build()
    inputs, targets = example_batch(spec, job.batch_size, job.seed)
    rank0 = topo.layout.rank == 0
    result: dict[str, Any] = {"runs": []}
    if job.profile_costs and rank0:
        # Time layers at the smallest micro-batch the job runs: the size whose per-message overhead matters.
        chunks = job.profile_chunks or max(job.microbatches, default=1)
        first = microbatch.scatter(inputs, chunks)[0], microbatch.scatter(targets, chunks)[0]
        result["costs"] = asdict(profile(spec, *first, job.seed))
        _save(result, job.out)
    for chunks in job.microbatches:
        stages = topo.layout.stages
        config = PipelineConfig(stages, chunks, topo.layout.replicas, len(job.balance) // stages, job.schedule,
                                job.checkpoint, tuple(job.balance), job.offload)
        pipe = build_pipeline(spec, topo, config, job.seed)
        figures = measure_engine(pipe, inputs, targets, job.batch_size, chunks, job.steps, job.warmup,
                                 trace=job.trace)
        pipe.close()
        if figures is not None:
            result["runs"].append(asdict(figures))
            _save(result, job.out)
    if job.host_overhead and job.stages == 1:
        from gpipe_cli.bench import overhead

        result["host_overhead"] = overhead.compare(spec, topo, inputs, targets, job.microbatches[0], job.schedule,
                                                   job.checkpoint, job.seed, job.steps, job.warmup, job.balance)
        _save(result, job.out)
    if job.compare:
        from gpipe_cli.bench import baseline

        result["compare"] = baseline.compare(spec, topo, job, inputs, targets)
    if rank0:
        _save(result, job.out)


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
        return ranks > gpus, counted(gpus, 'GPU')
    cores = usable_cores()
    return ranks * threads > cores, f"{cores} CPU core{'s' if cores != 1 else ''}"


def sweep_partitions(options: BenchOptions, layers: int) -> list[int]:
    """The K of `--sweep` that this machine hosts (any with --oversubscribe; none at all: the least K, flagged)."""
    ks = [k for k in SWEEP_PARTITIONS
          if k <= layers and (options.oversubscribe or not oversubscription(k, options.threads)[0])]
    return ks or [k for k in SWEEP_PARTITIONS[:1] if k <= layers]


def sweep_skipped(options: BenchOptions, layers: int) -> dict[int, str]:
    """Why each K of the paper's sweep that this machine or model does not run is left out."""
    ks = sweep_partitions(options, layers)
    return {k: f"the model has {layers} pipeline layers, fewer than K" if k > layers
            else "more ranks than this machine hosts (--oversubscribe runs them anyway)"
            for k in SWEEP_PARTITIONS if k not in ks}


def base_job(options: BenchOptions, subject: Subject, stages: int, balance: list[int], **fields: Any) -> Job:
    """A job with the options' model, batch, schedule and step counts (`fields`: the job's other fields)."""
    job = Job(subject=subject.to_json(), stages=stages, balance=balance, batch_size=options.batch,
              microbatches=options.microbatch_values(), schedule=options.schedule, checkpoint=options.checkpoint,
              steps=options.steps, warmup=options.warmup, seed=options.seed, out="", offload=options.offload)
    return replace(job, **fields)


def model_json(subject: Subject) -> dict[str, Any]:
    """What the JSON says about the model."""
    spec = subject.build()
    return {**subject.to_json(), "name": spec.name, "task": spec.task, "layers": len(spec.layers),
            "parameters": count_parameters(spec)}
