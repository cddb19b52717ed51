"""The engine's host overhead: K=1 engine steps against a plain PyTorch loop over the same layers."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_cli.bench.options import overhead_rounds
from gpipe_cli.estimate.measure import Load, build_pipeline, timed
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import context, microbatch
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.device import to_device
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.tied import tie_within
from gpipe_cli.pipeline.topology import Topology


def remat_microbatches(schedule: str, chunks: int, checkpoint_mode: str, virtual: int = 1) -> list[int]:
    """The micro-batches the engine rematerialises at K=1 (in any of its V chunks), as its schedule marks them."""
    return sorted({mb for mb, _ in _remat_pairs(schedule, chunks, checkpoint_mode, virtual)})


def _remat_pairs(schedule: str, chunks: int, checkpoint_mode: str, virtual: int) -> set[tuple[int, int]]:
    return sched.rematerialised(sched.build(schedule, 0, 1, chunks, checkpoint_mode, virtual))


class PlainLoop:
    """The model's layers in one nn.Sequential, trained by plain gradient accumulation over M micro-batches."""

    def __init__(self, spec: ModelSpec, device: torch.device, seed: int, chunks: int,
                 remat: Collection[int | tuple[int, int]], balance: Sequence[int] = ()) -> None:
        # `remat`: micro-batches recomputed throughout, or (micro-batch, chunk) pairs of a model cut in `balance`.
        layers = build_layers(spec.factories(), range(len(spec.layers)), seed, device)
        self.module = nn.Sequential(OrderedDict((str(i), layer) for i, layer in enumerate(layers)))
        for group in spec.tied:  # one tensor, as the engine makes tied parameters within a stage
            tie_within(self.module, group)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.loss, self.units, self.device = spec.loss, spec.units, device
        chunk_of = [c for c, n in enumerate(balance or (len(layers),)) for _ in range(n)]
        self.cut = [(c, [layer for layer, of in zip(self.module, chunk_of) if of == c]) for c in sorted(set(chunk_of))]
        self.chunks = chunks
        self.remat = {pair for r in remat
                      for pair in ([r] if isinstance(r, tuple) else [(r, c) for c in set(chunk_of)])}
        self.rng_devices = [device] if device.type == "cuda" else []
        self.module.train()  # once, as the engine: visiting every module each step is work the engine skips

    def step(self, inputs: Any, targets: torch.Tensor, step: int = 0) -> float:
        """Optimizer step `step`'s mini-batch: drop the gradients, accumulate every micro-batch's, return the loss."""
        for p in self.params:
            p.grad = None
        xs = microbatch.scatter(to_device(inputs, self.device), self.chunks)
        ys = microbatch.scatter(targets, self.chunks)
        units = [float(self.units(y)) if self.units is not None else float(y.shape[0]) for y in ys]
        total = sum(units)
        losses = []
        # Each micro-batch runs as the engine's, so that its layers (dropout) draw what they draw there.
        offsets = microbatch.offsets(microbatch.sizes(microbatch.batch_size(inputs), self.chunks))
        for mb, (x, y) in enumerate(zip(xs, ys)):
            for chunk, layers in self.cut:
                # Remat as the engine does it, a chunk's forward without gradients, then again with them (the same
                # random numbers) for the backward: torch's checkpoint per layer costs more, which read as the
                # engine saving time.
                remat = (mb, chunk) in self.remat
                if remat:
                    with context.microbatch(step, offsets[mb]), torch.random.fork_rng(self.rng_devices), \
                            torch.no_grad():
                        _forward(layers, x)
                with context.microbatch(step, offsets[mb], recomputing=remat):
                    x = _forward(layers, x)
            loss = self.loss(x, to_device(y, self.device)) * (units[mb] / total)
            loss.backward()
            losses.append(loss.detach())
        return float(torch.stack(losses).sum())


def _forward(layers: Sequence[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _max_difference(ours: list[nn.Parameter], theirs: list[nn.Parameter]) -> float:
    """The largest difference between two lists of gradients, relative to the largest gradient."""
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
        return math.inf
    worst = scale = 0.0
    for a, b in zip(ours, theirs):
        if (a.grad is None) != (b.grad is None):
            return math.inf
        if a.grad is not None and b.grad is not None:
            worst = max(worst, float((a.grad - b.grad).abs().max()))
            scale = max(scale, float(a.grad.abs().max()))
    return worst / scale if scale else worst


# Neither side runs an optimizer step, so the weights stay put and every step of both computes the same thing; the
# sides alternate over rounds in one process, each keeping its best step, so drift in the load hits both alike.
def compare(spec: ModelSpec, topo: Topology, inputs: Any, targets: torch.Tensor, chunks: int, schedule: str,
            checkpoint_mode: str, seed: int, steps: int, warmup: int, balance: Sequence[int] = ()) -> dict[str, Any]:
    """Alternate K=1 engine and plain-loop steps: each side's best step, their difference, how far the gradients end."""
    # The K=1 engine: all of the model's layers on this rank, in V chunks as `balance` cuts them (a V schedule's 2).
    cut = tuple(balance) or (len(spec.layers),)
    remat = remat_microbatches(schedule, chunks, checkpoint_mode, len(cut))
    config = PipelineConfig(virtual=len(cut), schedule=schedule, checkpoint=checkpoint_mode, balance=cut)
    pipe = build_pipeline(spec, topo, config, seed)
    plain = PlainLoop(spec, topo.device, seed, chunks, _remat_pairs(schedule, chunks, checkpoint_mode, len(cut)), cut)
    index, plain_index = itertools.count(1), itertools.count(1)  # alike: the last steps' gradients are compared

    def engine() -> float | None:
        pipe.zero_grad()
        return pipe.train_step(inputs, targets, microbatches=chunks, step=next(index), measure_memory=False).loss

    sides: dict[str, Callable[[], Any]] = {"engine": engine,
                                           "plain": lambda: plain.step(inputs, targets, next(plain_index))}
    for side in sides.values():
        for _ in range(warmup):
            side()
    count, each = overhead_rounds(steps)
    times: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, Any] = {}
    load = Load()
    for _ in range(count):
        for name, side in sides.items():
            for _ in range(each):
                seconds, losses[name] = timed(side)
                times[name].append(seconds)
    machine = load.finish()
    # No optimizer step: the weights never moved, so each side's last step left gradients to compare.
    difference = _max_difference(pipe.parameters(), plain.params)
    pipe.close()
    best_engine, best_plain = min(times["engine"]), min(times["plain"])
    overhead = best_engine - best_plain
    return {
        "partitions": 1, "microbatches": chunks, "threads": torch.get_num_threads(),
        "engine_step_s": best_engine, "plain_step_s": best_plain,
        "plain_over_engine": best_plain / best_engine if best_engine else 0.0,
        "overhead_step_s": overhead, "overhead_per_microbatch_s": overhead / chunks,
        "statistic": "min", "rounds": count, "steps_per_round": each,
        "engine_step_times": times["engine"], "plain_step_times": times["plain"],
        "checkpoint": checkpoint_mode, "rematerialised": remat, "optimizer_step": False,
        "engine_loss": losses["engine"], "plain_loss": losses["plain"],
        "gradient_max_relative_difference": difference, "load": machine,
    }
