"""The plan of a run: the model, how it is cut into stages, and what each stage costs and holds."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table

from gpipe_cli import memory_model as mm
from gpipe_cli.console import figure_table
from gpipe_cli.errors import UserError
from gpipe_cli.estimate import kept
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import ModelSummary
from gpipe_cli.pipeline import partition, schedule
from gpipe_cli.recipe.load import led_by, parse_override
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe_model import batch_key, model_spec, optimizer_name, priced_batch
from gpipe_cli.train import cut
from gpipe_cli.units import counted, human_bytes, human_count


def checked_plan(recipe: Recipe, label: str, must_fit: bool = False, available: float | None = None,
                 sets: Sequence[str] = ()) -> Plan:
    """The plan, with problems reported against the recipe file (`must_fit`: also one too large for this machine)."""
    try:
        plan = make_plan(recipe, available=available)
    except UserError as exc:
        # A cut the layers cannot take names the `--set` that asked for it, as the schema's checks do.
        given = led_by(str(exc), {parse_override(item)[0] for item in sets})
        raise UserError(f"{label}: {'--set ' if given else ''}{exc}") from None
    if must_fit and not plan.fits:
        raise UserError(f"{label}: {plan.misfit()}")
    return plan


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one stage holds, by kind, from the memory model (measure them with `gpipe profile-memory`)."""

    params: int
    grads: int
    optimizer: int
    stored: int        # activations kept from forwards when the backward phase starts
    activations: int   # the activation peak of the step (stored plus the micro-batch being backpropagated)
    host: int = 0      # the most activations waiting in host memory at once (pipeline.offload)

    @property
    def total(self) -> int:
        """What the device needs at the stage's peak."""
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers, parameters, estimated forward cost and memory."""

    index: int
    first_layer: int
    layers: list[str]
    params: int
    flops: int  # forward FLOPs per example
    memory: MemoryEstimate
    capacity: int  # the memory this stage's rank has (see `Plan.capacity`)
    host_capacity: int = 0  # the host memory its rank may fill with offloaded activations (0: the CPU, one RAM)

    def over(self) -> str:
        """By how much the stage does not fit, in words ('' when it fits)."""
        if self.host_capacity == 0:  # on the CPU the offloaded copies share the RAM with everything else
            extra = self.memory.total + self.memory.host - self.capacity
            host = f" (with {human_bytes(self.memory.host)} offloaded)" if self.memory.host else ""
            return f"needs {human_bytes(self.memory.total + self.memory.host)}{host}, {human_bytes(extra)} over" \
                if extra > 0 else ""
        if self.memory.total > self.capacity:
            return f"needs {human_bytes(self.memory.total)}, {human_bytes(self.memory.total - self.capacity)} over"
        if self.memory.host > self.host_capacity:
            return (f"offloads {human_bytes(self.memory.host)} to host memory, "
                    f"{human_bytes(self.memory.host - self.host_capacity)} over its share of the RAM "
                    f"({human_bytes(self.host_capacity)})")
        return ""

    @property
    def fits(self) -> bool:
        """Whether the stage's estimate fits the memory its rank has (and its offloaded bytes the host's)."""
        return not self.over()


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
    capacity: str  # what the ranks run on, e.g. "22.1 GiB of available RAM shared by 4 ranks"
    no_cut_fits: str = ""  # `balance: auto` found no cut whose every stage fits: why, with the numbers
    batch_key: str = "data.batch_size"  # the key that sizes a mini-batch (data.tokens_per_batch under a budget)
    tokens: int = 0  # a text model's activations are priced at examples of this many tokens (model.max_len)
    microbatch_least: int = 0  # the smallest micro-batch, where the batch does not split evenly (0: all alike)

    @property
    def fits(self) -> bool:
        """Whether every stage fits its rank's memory."""
        return all(s.fits for s in self.stages)

    def misfit(self) -> str:
        """The stages that do not fit, with the numbers, as one line ('' when all fit)."""
        over = [s for s in self.stages if not s.fits]
        if not over:
            return ""
        if self.no_cut_fits:
            return self.no_cut_fits
        if len(over) > 2:  # every stage named would push the advice out of the one line an error gets
            worst = max(over, key=lambda s: s.memory.total + s.memory.host)
            parts = (f"{len(over)} of {len(self.stages)} stages are over, stage {worst.index} the most: "
                     f"it {worst.over()}")
        else:
            parts = ", ".join(f"stage {s.index} {s.over()}" for s in over)
        return (f"the plan does not fit this machine: {parts}; each rank has {human_bytes(over[0].capacity)} "
                f"({self.capacity}). {self._change(over)}")

    def _change(self, over: list[StagePlan]) -> str:
        """What to change: what lowers activations, unless some stage's weights alone are over."""
        weights = [s.memory.params + s.memory.grads + s.memory.optimizer for s in self.stages]
        heaviest = max(over, key=lambda s: weights[s.index])
        need, capacity = weights[heaviest.index], heaviest.capacity
        if need <= capacity:
            return cut.lower_activations(self.batch_key, self.checkpoint)
        said = f"{human_bytes(need)} on stage {heaviest.index}"
        # No cut but this one (one chunk, or a layer each: `balance: auto` cuts to fit memory otherwise).
        one_layer = len(heaviest.layers) == 1  # a layer each: no cut lightens it
        if sum(weights) > capacity * self.partitions or len(self.balance) == 1 or one_layer:
            return cut.weights_over(said, sum(weights), capacity, heaviest.host_capacity == 0, one_layer)
        return (f"Weights, gradients and optimizer state alone need {said} of this cut: "
                f"set pipeline.balance: auto, which cuts to fit memory")

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON-able data."""
        out = asdict(self)
        for stage, plan in zip(out["stages"], self.stages):
            stage["memory"]["total"] = plan.memory.total
            stage["fits"] = plan.fits
        out["fits"] = self.fits
        return out


def resolve_balance(recipe: Recipe, summary: ModelSummary, measured: list[float] | None = None,
                    measured_by: str | None = None,
                    memory: mm.CutMemory | None = None) -> tuple[list[int], str, str]:
    """The layers per stage, what they were balanced by, and why no cut fits memory ('' when one does)."""
    # `measured`: per-layer costs measured at launch, named `measured_by` in the plan ("measured time, cached").
    k, layers = recipe.pipeline.partitions * recipe.pipeline.virtual_stages, len(summary.layers)  # chunks
    balance = recipe.pipeline.balance
    explicit = checked_cut(recipe, layers)
    if explicit is not None:
        return explicit, "pipeline.balance", ""
    with _cut_errors(recipe):
        if balance == "params":
            return partition.balance_by_cost([c.params for c in summary.layers], k), "parameters", ""
        if balance in ("auto", "time") and k in (1, layers):  # nothing to choose, nothing to measure
            return [layers // k] * k, "the only cut", ""
        if measured is not None:
            costs, by = measured, measured_by or f"measured {balance}"
        else:
            flops = [float(c.flops) for c in summary.layers]
            costs = flops if any(flops) else [float(c.params) for c in summary.layers]
            later = f"gpipe train measures {'time' if balance == 'auto' else balance} at launch"
            by = measured_by or f"estimated FLOPs ({later})"
            if not any(flops):  # no FLOP estimate for this model: the estimate is its parameters
                by = by.replace("estimated FLOPs", "parameters (no FLOP estimate)", 1)
        if balance != "auto" or memory is None:
            return partition.balance_by_cost(costs, k), by, ""
        try:
            chosen, moved = cut.within_memory(costs, memory, recipe.pipeline.virtual_stages)
        except cut.NoCutFits as exc:  # shown as the fastest cut; `gpipe train` refuses with this line
            return partition.balance_by_cost(costs, k), f"{by}; no cut fits memory", exc.line(batch_key(recipe))
        return chosen, (f"{by}, the fastest cut that fits memory" if moved else by), ""


def checked_cut(recipe: Recipe, layers: int) -> list[int] | None:
    """Refuse K x V chunks, or an explicit balance, that the model's `layers` cannot take; the explicit balance."""
    pipe = recipe.pipeline
    chunks = pipe.partitions * pipe.virtual_stages
    with _cut_errors(recipe):
        partition.check_chunks(layers, pipe.partitions, pipe.virtual_stages)
        if isinstance(pipe.balance, list):
            return partition.check_balance(pipe.balance, layers, chunks)
    return None


@contextlib.contextmanager
def _cut_errors(recipe: Recipe) -> Iterator[None]:
    """A cut the model's layers cannot take, as one line naming the recipe key that asked for it."""
    try:
        yield
    except partition.PartitionError as exc:
        pipe = recipe.pipeline
        if isinstance(exc, partition.TooManyChunks):
            raise UserError(str(exc)) from None
        key = "pipeline.balance" if isinstance(pipe.balance, list) else "pipeline.partitions"
        if pipe.virtual_stages > 1 and not isinstance(pipe.balance, list):
            key = f"pipeline.partitions x pipeline.virtual_stages ({pipe.partitions * pipe.virtual_stages} chunks)"
        raise UserError(f"{key}: {exc}") from None


def examples_per_replica(recipe: Recipe) -> int:
    """The examples of the model's full length one replica's step is priced at."""
    pipe, total = recipe.pipeline, priced_batch(recipe)
    if recipe.data.tokens_per_batch is not None:  # or the M x D examples every budget batch holds at least
        total = max(total, pipe.microbatches * pipe.data_parallel)
    return max(total // pipe.data_parallel, 1)


def microbatch_size(recipe: Recipe) -> int:
    """Examples in the largest micro-batch of one replica."""
    return max(math.ceil(examples_per_replica(recipe) / recipe.pipeline.microbatches), 1)


def make_plan(recipe: Recipe, spec: ModelSpec | None = None, measured: list[float] | None = None,
              device: str | None = None, available: float | None = None, measured_by: str | None = None,
              chosen: tuple[list[int], str] | None = None) -> Plan:
    """The plan of `recipe`, cut by `measured` costs or as `chosen` says, checked against the memory of `device`."""
    # `device` None: CUDA if present, else the CPU; `available` None: the bytes free now.
    spec = spec or model_spec(recipe)
    pipe = recipe.pipeline
    if chosen is None:  # an impossible cut: refused before the seconds of describing and measuring the model
        checked_cut(recipe, len(spec.layers))
    per_replica = examples_per_replica(recipe)
    mb = microbatch_size(recipe)
    summary = kept.summary(spec, mb)
    figures = kept.figures(spec)  # shapes only: prices models of any size at once
    per_param = kept.bytes_per_parameter(optimizer_name(recipe))
    ranks = pipe.partitions * pipe.data_parallel
    room = mm.capacity(ranks, device, available)
    host_room = 0 if room.shared else int(mm.capacity(ranks, "cpu").per_rank_bytes)  # the CPU: the same RAM
    stage_memory = mm.CutMemory(figures, pipe.partitions, per_replica, pipe.microbatches, pipe.schedule,
                                pipe.checkpoint, per_param, room.per_rank_bytes, room.description, pipe.offload,
                                room.shared)
    refusal = ""
    if chosen is not None:
        balance, balance_by = chosen
    else:
        balance, balance_by, refusal = resolve_balance(recipe, summary, measured, measured_by, stage_memory)
    prints = mm.footprints(figures, balance, per_replica, pipe.microbatches, pipe.schedule, pipe.checkpoint,
                           per_param, pipe.virtual_stages, pipe.offload)
    stages = []
    # Each stage's chunks as the memory model places them, which is as the engine does (a V's too).
    for s, (fp, spans) in enumerate(zip(prints, mm.stage_chunks(balance, pipe.schedule, pipe.virtual_stages))):
        indices = [i for span in spans for i in span]
        param_bytes = fp.params * mm.PARAM_BYTES  # a tied weight once on a stage that holds both of its layers
        memory = MemoryEstimate(param_bytes, param_bytes, round(fp.weights_bytes) - 2 * param_bytes,
                                round(fp.stored_bytes), round(fp.peak_bytes), round(fp.host_bytes))
        stages.append(StagePlan(
            index=s, first_layer=spans[0].start, layers=[summary.layers[i].name for i in indices],
            params=fp.params,
            flops=sum(summary.stage_flops(r.start, r.stop) for r in spans),
            memory=memory, capacity=int(room.per_rank_bytes), host_capacity=host_room))
    return Plan(model=spec.name, task=spec.task, total_params=summary.total_params, partitions=pipe.partitions,
                microbatches=pipe.microbatches, data_parallel=pipe.data_parallel, microbatch_size=mb,
                balance=balance, balance_by=balance_by, schedule=pipe.schedule, checkpoint=pipe.checkpoint,
                bubble_theory=schedule.theoretical_bubble(pipe.partitions, pipe.microbatches, pipe.schedule,
                                                          pipe.virtual_stages),
                stages=stages, capacity=room.description, no_cut_fits=refusal,
                batch_key=batch_key(recipe), tokens=getattr(recipe.model, "max_len", 0),
                microbatch_least=per_replica // pipe.microbatches if recipe.data.tokens_per_batch is None else 0)


def _layers(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]} … {names[-1]} ({len(names)})"


def _sizes(plan: Plan) -> str:
    """The examples a micro-batch holds: '8', or '7 to 8' where the batch does not split evenly."""
    least = plan.microbatch_least or plan.microbatch_size
    return f"{least} to {plan.microbatch_size}" if least != plan.microbatch_size else str(plan.microbatch_size)


def plan_table(plan: Plan) -> Table:
    """One row per stage: layers, parameters, forward FLOPs, estimated peak memory and whether it fits."""
    offloads = any(s.memory.host for s in plan.stages)  # pipeline.offload: what waits in host memory, beside
    table = figure_table(f"{plan.model}: {human_count(plan.total_params)} parameters, "
                         f"{counted(plan.partitions, 'stage')} x {counted(plan.data_parallel, 'replica')}, "
                         f"{counted(plan.microbatches, 'micro-batch', 'micro-batches')} of {_sizes(plan)}",
                         ("stage", "layers", "params", "GFLOP per example", "memory (est.)", "of which activations",
                          *(("offloaded to host",) if offloads else ()), "fits"), left=("layers",),
                         title_justify="left")
    for s in plan.stages:
        fits = "yes" if s.fits else f"[bold red]no: {s.over()}[/]"
        table.add_row(str(s.index), _layers(s.layers), human_count(s.params), f"{s.flops / 1e9:.3f}",
                      human_bytes(s.memory.total), human_bytes(s.memory.activations),
                      *((human_bytes(s.memory.host),) if offloads else ()), fits)
    over = sum(not s.fits for s in plan.stages)
    verdict = "every stage fits" if plan.fits else f"{over} stage{'' if over == 1 else 's'} of {len(plan.stages)} " \
        f"{'does' if over == 1 else 'do'} not fit"
    held = sum(s.params for s in plan.stages)
    tied = (f"; each stage holds its own copy of a tied weight (the stages' params add up to {human_count(held)})"
            if held > plan.total_params else "")
    away = ", activations offloaded to host memory" if offloads else ""
    # Real sentences are mostly shorter: the quick start is priced at 9.2 and 13.5 MiB, its stages measured 2.1-5.4.
    worst = (f"; activations priced at examples of model.max_len, {plan.tokens} tokens (shorter ones hold less)"
             if plan.tokens else "")
    table.caption = (f"balance {plan.balance} by {plan.balance_by}{tied}; schedule {plan.schedule}, "
                     f"rematerialization {plan.checkpoint}{away}; theoretical bubble {plan.bubble_theory:.3f}"
                     f"{worst}\n"
                     f"memory: {human_bytes(plan.stages[0].capacity)} per rank ({plan.capacity}): {verdict}")
    return table
