"""A benchmark job: what K ranks measure, and how each rank does it.

Rank 0 writes the figures as JSON to the job's `out` path after every phase, so a failure late in
the job (a baseline) still leaves the earlier figures behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe_cli.estimate import costs
from gpipe_cli.estimate.measure import build_pipeline, measure_engine
from gpipe_cli.estimate.subject import Subject, example_batch
from gpipe_cli.files import atomic_write_text
from gpipe_cli.pipeline import microbatch, topology
from gpipe_cli.pipeline.config import PipelineConfig


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
        result["costs"] = costs.profile(spec, *first, job.seed).to_json()
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
            result["runs"].append(figures.to_json())
            _save(result, job.out)
    if job.host_overhead and job.stages == 1:
        from gpipe_cli.bench import overhead

        result["host_overhead"] = overhead.compare(spec, topo, inputs, targets, job.microbatches[0], job.schedule,
                                                   job.checkpoint, job.seed, job.steps, job.warmup)
        _save(result, job.out)
    if job.compare:
        from gpipe_cli.bench import baseline

        result["compare"] = baseline.compare(spec, topo, job, inputs, targets)
    if rank0:
        _save(result, job.out)
