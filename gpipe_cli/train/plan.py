"""The plan of a run: the model, how it is cut into stages, and what each stage costs and holds.

Computed without training or reading data (layers are built on the meta device), so `gpipe validate`
can show it at once; `gpipe train` executes the same plan.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpipe_cli.errors import UserError
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import ModelSummary, describe
from gpipe_cli.pipeline import partition, schedule
from gpipe_cli.recipe.schema import Recipe

_OPTIMIZER_SLOTS = {"sgd": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "amoebanet-rmsprop": 2}


def model_spec(recipe: Recipe) -> ModelSpec:
    """The ModelSpec a recipe's model section describes."""
    from gpipe_cli.models.registry import build_model

    params = recipe.model.model_dump(exclude={"kind", "preset"})
    try:
        return build_model(recipe.model.kind, **params)
    except ValueError as exc:
        raise UserError(f"model: {exc}") from None


def checked_plan(recipe: Recipe, label: str) -> Plan:
    """The plan, with problems reported against the recipe file."""
    try:
        return make_plan(recipe)
    except UserError as exc:
        raise UserError(f"{label}: {exc}") from None


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one stage holds at its peak, by kind (an estimate from shapes; measure with profile-memory)."""

    params: int
    grads: int
    optimizer: int
    stored_inputs: int
    activations: int

    @property
    def total(self) -> int:
        """The sum of all kinds."""
        return self.params + self.grads + self.optimizer + self.stored_inputs + self.activations


@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers, parameters, estimated forward cost and memory."""

    index: int
    first_layer: int
    layers: list[str]
    params: int
    flops: int  # forward FLOPs per example
    memory: MemoryEstimate


@dataclass(frozen=True)
class Plan:
    """How a recipe's model is cut and run."""

    model: str
    task: str
    total_params: int
    partitions: int
    microbatches: int
    data_parallel: int
    microbatch_size: int
    balance: list[int]
    balance_by: str
    schedule: str
    checkpoint: str
    bubble_theory: float
    stages: list[StagePlan]

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON-able data."""
        out = asdict(self)
        for stage, plan in zip(out["stages"], self.stages):
            stage["memory"]["total"] = plan.memory.total
        return out


def _saved_bytes_per_example(spec: ModelSpec, batch: int) -> list[int]:
    """Bytes autograd saves inside each layer per example, from a forward on the meta device."""
    inputs, _ = spec.example_batch(batch, "meta")
    per_layer: list[int] = []
    x = inputs
    with torch.device("meta"):
        for layer in spec.layers:
            module = layer.build()
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
                seen.setdefault(id(t), t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                x = module(_requiring_grad(x))
            per_layer.append(sum(seen.values()) // batch)
            x = _detached(x)
    return per_layer


def _requiring_grad(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    return tuple(_requiring_grad(t) for t in x)


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else tuple(_detached(t) for t in x)


def resolve_balance(recipe: Recipe, summary: ModelSummary,
                    measured: list[float] | None = None) -> tuple[list[int], str]:
    """The layers per stage and what they were balanced by."""
    k, layers = recipe.pipeline.partitions, len(summary.layers)
    balance = recipe.pipeline.balance
    try:
        partition.check_partitions(layers, k)
        if isinstance(balance, list):
            return partition.check_balance(balance, layers, k), "explicit"
        if balance == "params":
            return partition.balance_by_cost([c.params for c in summary.layers], k), "parameters"
        if balance in ("time", "memory") and measured is not None:
            return partition.balance_by_cost(measured, k), f"measured {balance}"
        flops = [float(c.flops) for c in summary.layers]
        note = "estimated FLOPs" if balance == "auto" else f"estimated FLOPs (measured {balance} at launch)"
        return partition.balance_by_cost(flops if any(flops) else [c.params for c in summary.layers], k), note
    except partition.PartitionError as exc:
        key = "pipeline.balance" if isinstance(balance, list) else "pipeline.partitions"
        raise UserError(f"{key}: {exc}") from None


def make_plan(recipe: Recipe, spec: ModelSpec | None = None, measured: list[float] | None = None) -> Plan:
    """The plan of `recipe` (balanced by `measured` per-layer costs when given)."""
    spec = spec or model_spec(recipe)
    pipe = recipe.pipeline
    per_replica = max(recipe.data.batch_size // pipe.data_parallel, 1)
    mb = max(math.ceil(per_replica / pipe.microbatches), 1)
    summary = describe(spec, mb)
    balance, balance_by = resolve_balance(recipe, summary, measured)
    saved = _saved_bytes_per_example(spec, mb)
    opt = recipe.optimizer
    slots = _OPTIMIZER_SLOTS[opt.name] - (opt.name == "sgd" and opt.momentum == 0)  # plain SGD keeps no state
    stages = []
    for s, span in enumerate(partition.stage_ranges(balance)):
        order = schedule.forward_order(pipe.schedule, s, pipe.partitions, pipe.microbatches)
        remat = schedule.remat_plan(pipe.checkpoint, order)
        in_flight = max(_in_flight(order), 1)
        param_bytes = sum(summary.layers[i].param_bytes for i in span)
        working = sum(saved[i] for i in span) * mb
        stored = len(remat) * summary.cut_bytes(span.start - 1) * mb
        activations = (in_flight - min(len(remat), in_flight - 1)) * working
        stages.append(StagePlan(
            index=s, first_layer=span.start, layers=[summary.layers[i].name for i in span],
            params=summary.stage_params(span.start, span.stop), flops=summary.stage_flops(span.start, span.stop),
            memory=MemoryEstimate(param_bytes, param_bytes, slots * param_bytes, stored, activations)))
    return Plan(model=spec.name, task=spec.task, total_params=summary.total_params, partitions=pipe.partitions,
                microbatches=pipe.microbatches, data_parallel=pipe.data_parallel, microbatch_size=mb,
                balance=balance, balance_by=balance_by, schedule=pipe.schedule, checkpoint=pipe.checkpoint,
                bubble_theory=schedule.theoretical_bubble(pipe.partitions, pipe.microbatches), stages=stages)


def _in_flight(order: list[tuple[str, int]]) -> int:
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak
