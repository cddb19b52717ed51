"""What each rank runs in the profile tests (importable by spawned processes)."""

from __future__ import annotations

from gpipe_cli.estimate.measure import build_pipeline
from gpipe_cli.estimate.subject import Subject, example_batch
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig


def engine_peaks(subject: dict, stages: int, batch: int, configs: list[tuple[int, str, str, list[int]]]) -> dict:
    """Each configuration's per-stage activation peaks as the engine measures them in a real step (rank 0)."""
    spec = Subject.from_json(subject).build()
    topo = topology.init(stages)
    inputs, targets = example_batch(spec, batch, 0)
    out = {}
    for chunks, schedule, checkpoint, balance in configs:
        config = PipelineConfig(stages, chunks, 1, len(balance) // stages, schedule, checkpoint, tuple(balance))
        pipe = build_pipeline(spec, topo, config, 0)
        result = pipe.train_step(inputs if topo.layout.is_first else None, targets if topo.layout.is_last else None,
                                 microbatches=chunks, step=0)
        pipe.close()
        if result.stats is not None:
            out[(chunks, schedule, checkpoint)] = [s.activation_peak for s in
                                                   sorted(result.stats.stages, key=lambda s: s.stage)]
    return out
