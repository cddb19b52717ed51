"""What each rank runs in the multi-process engine tests (importable by spawned processes)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline import failure, topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers, stage_ranges
from tests.pipeline import toy


def make_pipeline(model: str, topo: topology.Topology, balance: list[int], **options: Any) -> Pipeline:
    """A toy pipeline; `balance` lists K x V chunks (V = its length / K)."""
    spec = toy.MODELS[model]
    factories = spec["factories"]()
    stages = topo.layout.stages
    config = PipelineConfig(stages, replicas=topo.layout.replicas, virtual=len(balance) // stages,
                            balance=tuple(balance), **options)
    layers = build_layers(factories, stage_layers(balance, stages, topo.layout.stage, config.placement), toy.SEED)
    return Pipeline(layers, topo, config, spec["loss"], tied=spec["tied"])


def train(pipe: Pipeline, model: str, microbatches: int, steps: int = 3, norms: list[float] | None = None,
          max_grad_norm: float | None = None) -> list[float | None]:
    """Run the toy steps on this rank's shard; return the losses (on the last stages and rank 0), and append each
    step's global gradient norm to `norms`."""
    layout = pipe.layout
    opt = toy.optimizer(pipe.parameters())
    losses = []
    for step in range(steps):
        x, y = toy.batch(model, step, toy.SIZES[step])
        sx, sy, offset = toy.shards(x, y, layout.replicas)[layout.replica]
        result = pipe.train_step(sx if layout.is_first else None, sy if layout.is_last else None,
                                 microbatches=microbatches, step=step, example_offset=offset,
                                 max_grad_norm=max_grad_norm)
        opt.step()
        pipe.zero_grad()
        losses.append(result.loss)
        if norms is not None:
            norms.append(result.grad_norm)
    return losses


def clipped(model: str, stages: int, balance: list[int], microbatches: int, max_grad_norm: float) -> dict:
    """Train clipping at `max_grad_norm`; return this rank's state and the norms it read."""
    topo = topology.init(stages)
    pipe = make_pipeline(model, topo, balance, schedule="1f1b", microbatches=microbatches)
    norms: list[float] = []
    train(pipe, model, microbatches, norms=norms, max_grad_norm=max_grad_norm)
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return {"state": state, "norms": norms}


def grid(model: str, stages: int, balance: list[int], configs: list[tuple]) -> dict:
    """Train every (M, schedule, remat[, chunk balance]) configuration from scratch; return each final state."""
    topo = topology.init(stages)
    out = {}
    for microbatches, schedule, checkpoint, *chunks in configs:
        pipe = make_pipeline(model, topo, list(chunks[0]) if chunks else balance, schedule=schedule,
                             checkpoint=checkpoint, microbatches=microbatches)
        train(pipe, model, microbatches)
        out[(microbatches, schedule, checkpoint, *chunks)] = {k: v.clone() for k, v in pipe.state_dict().items()}
        pipe.close()
    return out


def data_parallel(model: str, stages: int, replicas: int, balance: list[int], microbatches: int,
                  schedule: str = "1f1b") -> dict:
    """Train with K stages × D replicas; return this rank's state and losses."""
    topo = topology.init(stages, replicas)
    pipe = make_pipeline(model, topo, balance, schedule=schedule, microbatches=microbatches)
    losses = train(pipe, model, microbatches)
    pipe.close()
    return {"stage": topo.layout.stage, "replica": topo.layout.replica, "state": pipe.state_dict(),
            "losses": losses}


def evaluate(model: str, stages: int, balance: list[int], size: int, microbatches: int,
             schedule: str = "gpipe") -> dict:
    """Train a step, then evaluate a batch (possibly smaller than M); return rank 0's view."""
    topo = topology.init(stages)
    pipe = make_pipeline(model, topo, balance, schedule=schedule, microbatches=microbatches)
    train(pipe, model, microbatches, steps=1)
    x, y = toy.batch(model, 7, size)
    layout = pipe.layout

    def correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (logits.argmax(-1) == targets).sum()

    result = pipe.evaluate(x if layout.is_first else None, y if layout.is_last else None,
                           microbatches=microbatches, metrics={"correct": correct}, return_outputs=True)
    pipe.close()
    return {"rank": layout.rank, "loss": result.loss, "units": result.units, "metrics": result.metrics,
            "outputs": result.outputs, "state": pipe.state_dict()}


class Unstable(nn.Module):
    """A layer that raises at a given step."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.lin, self.calls, self.fail_at = nn.Linear(16, 16), 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.fail_at:
            raise ValueError("boom: this layer is broken")
        return self.lin(x)


def failing(stages: int, failing_stage: int) -> None:
    """A pipeline whose stage `failing_stage` raises during the second step."""
    topo = topology.init(stages)
    label = f"stage {topo.layout.stage} (rank {topo.layout.rank})"
    watch = failure.AbortWatch(label)

    def run() -> None:
        factories = [lambda: nn.Linear(16, 16)] * stages
        factories[failing_stage] = lambda: Unstable(fail_at=2)
        layers = build_layers(factories, [topo.layout.stage], 0)
        pipe = Pipeline(layers, topo, PipelineConfig(stages, balance=(1,) * stages), nn.MSELoss())
        for step in range(50):
            x = torch.randn(4, 16)
            pipe.train_step(x, x, microbatches=2, step=step)
            time.sleep(0.01)

    failure.run_guarded(run, label, watch)


def varying_shapes(balance: list[int]) -> list[float | None]:
    """Train on batches whose sequence length changes every step; return the losses."""
    topo = topology.init(len(balance))
    layers = build_layers(shape_model(), stage_ranges(balance)[topo.layout.stage], toy.SEED)
    pipe = Pipeline(layers, topo, PipelineConfig(len(balance), balance=tuple(balance)), nn.CrossEntropyLoss())
    opt = toy.optimizer(pipe.parameters())
    losses = []
    for step, (x, y) in enumerate(shape_batches()):
        losses.append(pipe.train_step(x, y, microbatches=3, step=step).loss)
        opt.step()
        pipe.zero_grad()
    pipe.close()
    return losses


def shape_model() -> list:
    return [lambda: nn.Linear(4, 8), lambda: nn.Sequential(nn.Tanh(), nn.Linear(8, 8)), MeanHead]


class MeanHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mean(1))


def shape_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, length, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n, length in [(7, 5), (7, 9), (4, 2), (9, 13), (5, 1)]]
