"""What the plan's search is fed for a recipe's model: per-layer seconds and the memory model's figures."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe_cli import contention, interrupts, sizing
from gpipe_cli import memory_model as mm
from gpipe_cli.estimate import costs as layer_costs
from gpipe_cli.estimate import kept
from gpipe_cli.estimate.costs import CostProfile, LayerTiming
from gpipe_cli.estimate.measure import timed
from gpipe_cli.estimate.simulate import Link, rate_model
from gpipe_cli.estimate.subject import example_batch
from gpipe_cli.memory_model import ModelFigures
from gpipe_cli.models import families
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import tie_groups
from gpipe_cli.models.registry import build_model
from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm
from gpipe_cli.pipeline.layers import on_meta
from gpipe_cli.plan import calibrate, here
from gpipe_cli.plan.calibrate import Examples
from gpipe_cli.plan.options import PlanOptions
from gpipe_cli.plan.sample import Sample
from gpipe_cli.plan.search import Model, allreduce_seconds
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe_model import build_optimizer, optimizer_name, priced_batch
from gpipe_cli.units import flop_rate

# Time spent measuring per-layer seconds is worth it up to about this; beyond, estimate from FLOPs.
MEASURE_BUDGET_S = 60.0
REPEATS = 5
# A layer's fixed cost on an accelerator (its kernels' launches) when per-layer seconds are estimated from
# an assumed rate: a few kernels of about 5 µs each.
ASSUMED_CALL_S = 50e-6


@dataclass(frozen=True)
class Inputs:
    """The model as the search sees it, and how its figures were obtained (for the output)."""

    model: Model
    timing: str        # e.g. "measured on cpu (1 thread) at micro-batches of 2 and 64 examples"
    memory: str        # e.g. "shapes of every layer" or "extrapolated from a 9-layer member"
    drift: float | None = None    # how much one engine step moved from the start to the end of measuring
    # What others took of the CPU while each speed figure was timed, by what it timed (contention.note's windows)
    loads: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def _probe_params(kind: str, params: dict[str, Any]) -> dict[str, Any] | None:
    # The shallow member that prices a deep model (all its kinds of layer present).
    depth = families.of(kind).plan_probe_layers
    if not isinstance(params.get("layers"), int) or params["layers"] <= depth:
        return None
    return {**params, "layers": depth}


def _flops(spec: ModelSpec) -> list[float]:
    """Forward FLOPs per example of every layer (two examples described: BatchNorm needs them)."""
    return [c.flops / 2 for c in kept.summary(spec, 2).layers]


def figures(kind: str, params: dict[str, Any], spec: ModelSpec) -> tuple[ModelFigures, list[float], str]:
    """The memory model's figures and forward FLOPs per example of every layer, and how they were found."""
    probe = _probe_params(kind, params)
    if probe is not None:
        shallow = build_model(kind, **probe)
        measured = kept.figures(shallow)
        by_role = {mm.role(layer.name): layer for layer in measured.layers}
        flops_by_role = dict(zip((mm.role(n) for n in shallow.layer_names), _flops(shallow)))
        names = spec.layer_names
        # Else a kind of layer the shallow member lacks: the model itself is measured.
        if all(mm.role(n) in by_role for n in names):
            layers = tuple(dataclasses.replace(by_role[mm.role(n)], name=n) for n in names)
            note = f"extrapolated from the {probe['layers']}-layer member (each layer priced by its kind)"
            flops = [flops_by_role[mm.role(n)] for n in names]
            return ModelFigures(measured.input, layers, tie_groups(spec)), flops, note
    return kept.figures(spec), _flops(spec), "shapes of every layer (meta device)"


def affine_costs(lo: CostProfile, hi: CostProfile) -> Callable[[int], CostProfile]:
    """Per-layer seconds at any micro-batch size, affine through two measured profiles (proportional if one)."""
    span = hi.microbatch_size - lo.microbatch_size

    def at(size: int) -> CostProfile:
        def line(a: float, b: float) -> float:
            if not span:
                return a * size / lo.microbatch_size
            return max(a + (b - a) * (size - lo.microbatch_size) / span, 0.0)
        layers = [LayerTiming(x.name, line(x.forward, y.forward), line(x.forward_nograd, y.forward_nograd),
                              line(x.backward, y.backward), round(line(x.output_bytes, y.output_bytes)),
                              None if x.recompute is None else line(x.recompute_seconds, y.recompute_seconds))
                  for x, y in zip(lo.layers, hi.layers)]
        return CostProfile(size, round(line(lo.input_bytes, hi.input_bytes)), line(lo.loss, hi.loss), layers)
    return at


def estimated_costs(names: list[str], flops: list[float], figs: ModelFigures, rate: float,
                    per_call: float) -> Callable[[int], CostProfile]:
    """Per-layer seconds from FLOPs at an effective `rate` (FLOP/s) plus a fixed `per_call` per layer call."""
    def at(size: int) -> CostProfile:
        layers = []
        for name, f, fig in zip(names, flops, figs.layers):
            forward = f * size / rate + per_call
            layers.append(LayerTiming(name, forward, forward, 2 * forward, round(fig.output.at(size))))
        return CostProfile(size, round(figs.input.at(size)), 0.0, layers)
    return at


def measure_seconds(flops: list[float], sizes: tuple[int, int], machine: sizing.Machine, kind: str) -> float:
    """About how long measuring per-layer seconds of a model family `kind` at both sizes takes here."""
    rate, per_call = sizing.layer_rate(machine, kind)
    runs = 3 * (REPEATS + 1) + 2  # three kinds timed, plus warm-up and the memory pass
    return sum(sum(f * s / rate + per_call for f in flops) * 4 * runs / 3 for s in set(sizes))


def engine_seconds(costs: Callable[[int], CostProfile], examples: int, counts: list[int], ranks: int = 0,
                   stages: int = 1, steps: int = here.STEPS + 1, again: bool = True) -> float:
    """About how long timing the engine's steps takes: `ranks` processes started (0: none), `steps` per count."""
    # `again`: the first count once more at the end, as `here.engine_steps` does.
    runs = [*counts, *counts[:1]] if again else counts
    start = here.start_seconds(ranks) if ranks else 0.0
    # A step from the per-layer seconds, GPipe's bubble included (the engine's own costs are what is measured).
    return start + sum(steps * sum(costs(max(examples // m, 1)).balance_costs("never")) * (m + stages - 1) / stages
                       for m in runs)


def measured_costs(spec: ModelSpec, sizes: tuple[int, int], seed: int, threads: int,
                   examples: Examples, device: str = "cpu") -> Callable[[int], CostProfile]:
    """Per-layer seconds measured here on `device` at two micro-batch sizes, with `threads` intra-op threads."""
    profiles = []
    with sizing.torch_threads(threads):
        for size in sorted(set(sizes)):
            inputs, targets = examples(size)
            measured = layer_costs.profile(spec, inputs, targets.to(device), seed, REPEATS, device)
            profiles.append(dataclasses.replace(measured, microbatch_size=size))
            interrupts.check()
    return affine_costs(profiles[0], profiles[-1])


def _best_seconds(work: Callable[[], None], threads: int, runs: int = 2) -> float:
    """The fastest of `runs` timings of `work` with `threads` intra-op threads."""
    best = math.inf
    with sizing.torch_threads(threads):
        for _ in range(runs):
            best = min(best, timed(work)[0])
            interrupts.check()
    return best


def generated(spec: ModelSpec, seed: int) -> Examples:
    """Random examples of the model's full input shape (the same for a seed)."""
    return functools.partial(example_batch, spec, seed=seed)


_SIBLING_SPEC: dict[str, ModelSpec] = {}


def sibling_work(kind: str, params: dict[str, Any], inputs: Any, targets: torch.Tensor, seed: int) -> None:
    """What a sibling rank does while this one measures: the same per-layer timing (its model built once)."""
    if "spec" not in _SIBLING_SPEC:
        _SIBLING_SPEC["spec"] = build_model(kind, **params)
    layer_costs.profile(_SIBLING_SPEC["spec"], inputs, targets, seed, REPEATS)


@dataclass(frozen=True)
class _Engine:
    """The engine's own costs: per layer call and per step, its ratios on the layers' seconds, its steadiness."""

    overhead: calibrate.Overhead
    replicated: dict[int, float] = dataclasses.field(default_factory=dict)  # ratio by micro-batch size, K=1
    staged: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)  # the same, D=1, by V
    drift: float | None = None
    load: dict[str, float] = dataclasses.field(default_factory=dict)  # the most others took while it was timed


def _staged_counts(batch: int, sizes: list[int], ranks: int) -> list[int]:
    """M counts a `ranks`-stage pipeline is timed at: the replicas' sizes, M a multiple of K (interleaved needs it)."""
    return sorted({max(batch // size // ranks, 1) * ranks for size in sizes})


def _engine_costs(kind: str, params: dict[str, Any], spec: ModelSpec, costs: Callable[[int], CostProfile],
                  figs: ModelFigures, batch: int, least: int, seed: int, threads: int, examples: Examples,
                  ranks: int, links: tuple[Link, Link] | None, speedup: float, optimizer: here.OptimizerOf | None,
                  grad_clip: float | None, device: str, say: Callable[[str], None],
                  phase: Callable[[str, float], None]) -> _Engine:
    """The engine's own costs: on `ranks` real ranks when they share this machine, else in this process."""
    if ranks > 1 and links is not None and batch % ranks == 0:
        per_replica = batch // ranks
        staged_too = f", then as {ranks} stages," if len(spec.layers) >= ranks else ""
        replica_counts = calibrate.counts(per_replica, least)
        seconds = engine_seconds(costs, per_replica, replica_counts, ranks)
        staged_counts = _staged_counts(batch, [per_replica // m for m in replica_counts], ranks)
        pipelines = sum(len(spec.layers) >= ranks * v for v in (1, 2))  # GPipe, and 2 chunks per stage
        seconds += pipelines * engine_seconds(costs, batch, staged_counts, ranks, ranks)
        phase(f"measuring the engine's training steps on {ranks} replicas{staged_too} here", seconds)
        try:
            steps = here.engine_steps(kind, params, *examples(per_replica), seed, ranks, threads,
                                      replica_counts, optimizer, grad_clip)
        except here.Unavailable as exc:
            say(f"{exc}; measuring in this process instead")
        else:
            reduce = allreduce_seconds([sum(layer.params for layer in figs.layers)], ranks, links[1])
            update = statistics.fmean(u for _, u in steps.per_count.values())
            replicated = calibrate.factors([len(spec.layers)], costs, per_replica,
                                           {m: t for m, (t, _) in steps.per_count.items()}, reduce + update)
            staged: dict[int, dict[int, float]] = {}
            drift, sizes, load = steps.drift, sorted(replicated), steps.load
            # One pipeline of `ranks` stages on the whole batch, cut by time at the middle size: GPipe, and
            # interleaved with 2 chunks per stage (the V the search tries first).
            for virtual in (v for v in (1, 2) if len(spec.layers) >= ranks * v):
                balance = costs(sizes[len(sizes) // 2]).balance(ranks * virtual, "never")
                try:
                    piped = here.engine_steps(kind, params, *examples(batch), seed, ranks, threads,
                                              _staged_counts(batch, sizes, ranks), optimizer, grad_clip, balance,
                                              virtual)
                except here.Unavailable as exc:
                    say(f"{exc}; pipelines of {virtual} chunk(s) per stage are priced as the other shapes measured")
                    continue
                # The busiest stage's update is part of the step; it is charged per step apart (`Model.step_overhead`).
                measured = {m: step - own for m, (step, own) in piped.per_count.items()}
                staged[virtual] = calibrate.factors(balance, costs, batch, measured, 0.0, links[0],
                                                    rate_model(speedup, ranks), virtual)
                drift, load = max(drift, piped.drift, key=abs), contention.worst([load, piped.load])
            return _Engine(calibrate.Overhead(0.0, update), replicated, staged, drift, load)
    counts = calibrate.counts(batch, least)
    phase("measuring the engine's own cost per layer call and per step (one stage, this process)",
          engine_seconds(costs, batch, counts, steps=calibrate.STEPS + calibrate.WARMUP, again=False))
    alone = contention.Load()  # this process computes, no other of the plan's
    steps_here = calibrate.local_steps(spec, batch, counts, seed, threads, examples, optimizer, grad_clip, device)
    update = statistics.fmean(u for _, u in steps_here.values())
    extra = calibrate.overhead(len(spec.layers), costs, batch, {m: t for m, (t, _) in steps_here.items()}, update)
    return _Engine(extra, load=alone.finish())


def _ratios_text(engine: _Engine, ranks: int) -> str:
    """e.g. 'x1.73/1.79 on 2 replicas and x1.35/1.35 as 2 stages at micro-batches of 4/16 examples'."""
    def ratios(found: dict[int, float]) -> str:
        return "x" + "/".join(f"{found[n]:.2f}" for n in sorted(found))
    stages = "".join(f" and {ratios(found)} as {ranks} stages" + (f" of {v} chunks" if v > 1 else "")
                     for v, found in sorted(engine.staged.items()))
    return (f"{ratios(engine.replicated)} on {ranks} replicas{stages} at micro-batches of "
            f"{'/'.join(map(str, sorted(engine.replicated)))} examples")


# `sizes(min_microbatch)`: the micro-batch sizes the search tries; `sample`: the data to time on (else generated
# full-length examples); `siblings`: processes computing beside this one while it measures, as a machine's other
# ranks do, and with `links` the ranks the engine's costs are measured on; `device`: where layers and engine are
# timed (a GPU: one, alone); `phase(what, seconds)`: announces a long step with its estimate.
def inputs(recipe: Recipe, options: PlanOptions, sizes: Callable[[int], tuple[int, int]], threads: int,
           say: Callable[[str], None], phase: Callable[[str, float], None], sample: Sample | None, siblings: int,
           links: tuple[Link, Link] | None, device: str) -> Inputs:
    """Everything the plan's search needs of the model."""
    kind, seed, batch, timing, tflops = (recipe.model.kind, recipe.seed, priced_batch(recipe), options.timing,
                                         options.tflops)
    params = recipe.model.model_dump(exclude={"kind", "preset"})
    # A parameter with its gradient and optimizer state.
    bytes_per_param = kept.bytes_per_parameter(optimizer_name(recipe))
    spec = build_model(kind, **params)
    figs, flops, memory_note = figures(kind, params, spec)
    probe = _probe_params(kind, params)
    # A layer that normalises by batch statistics needs two examples per micro-batch.
    factories = (build_model(kind, **probe) if probe else spec).factories()
    with on_meta():
        modules = (module for factory in factories for module in factory().modules())
        least = 2 if any(isinstance(m, (DeferredBatchNorm, nn.modules.batchnorm._BatchNorm)) for m in modules) else 1
    if tflops is not None:
        note = (f"estimated from FLOPs at the assumed {tflops:g} TFLOP/s per device (--tflops) plus "
                f"{ASSUMED_CALL_S * 1e6:.0f} µs per layer call")
        costs = estimated_costs(spec.layer_names, flops, figs, tflops * 1e12, ASSUMED_CALL_S)
        return Inputs(Model(costs, figs, bytes_per_param, batch, least), note, memory_note)
    lo, hi = sizes(least)
    machine = sizing.this_machine(threads)
    seconds = measure_seconds(flops, (lo, hi), machine, kind)
    if timing == "auto":
        largest = max((layer.saved.at(hi) + mm.PARAM_BYTES * layer.params for layer in figs.layers), default=0.0)
        timing = "measure" if seconds <= MEASURE_BUDGET_S and largest < machine.memory_bytes * sizing.MEMORY_SHARE \
            else "estimate"
    if timing == "measure":
        plural = "s" if threads > 1 else ""
        sizes_text = f"{lo}{f' and {hi}' if hi != lo else ''}"
        if siblings:  # they start first; the largest size is timed twice alone and twice beside them
            seconds += here.start_seconds(siblings) + 4 * measure_seconds(flops, (hi, hi), machine, kind)
        phase(f"measuring per-layer seconds of {len(spec.layers)} pipeline layers at micro-batches of {sizes_text} "
              f"examples ({f'{threads} thread{plural}' if device == 'cpu' else f'on {device}'})", seconds)
        real = sample if sample is not None and sample.examples >= max(hi, batch) else None
        examples = real.take if real is not None else generated(spec, seed)
        work = functools.partial(sibling_work, kind, params, *examples(hi), seed)
        alone = _best_seconds(work, threads) if siblings else 0.0
        speedup = 1.0
        load = contention.Load()
        try:
            with here.loaded(work, siblings, threads):
                costs = measured_costs(spec, (lo, hi), seed, threads, examples, device)
                if siblings:
                    speedup = max(_best_seconds(work, threads) / alone, 1.0)
        except here.Unavailable as exc:
            say(f"{exc}; measuring alone")
            siblings = 0
            load = contention.Load()
            costs = measured_costs(spec, (lo, hi), seed, threads, examples, device)
        # The processes computing beside this one are the plan's own, yet read as others': alone only.
        loads = {} if siblings else {"per-layer seconds": load.finish()}
        interrupts.check()
        engine = _engine_costs(kind, params, spec, costs, figs, batch, least, seed, threads, examples, siblings + 1,
                               links, speedup, functools.partial(build_optimizer, recipe=recipe),
                               recipe.train.grad_clip, device, say, phase)
        extra = engine.overhead
        data = sample.build_seconds if sample is not None else 0.0
        where = real.note if real is not None else "generated data of the model's full length"
        beside = f", {siblings} other rank{'s' if siblings > 1 else ''} computing beside" if siblings else ""
        engine_note = (f"the engine adds {extra.action * 1e3:.2f} ms per layer call and {extra.step * 1e3:.1f} ms "
                       f"per step, its optimizer's update included (measured)" if not engine.replicated else
                       f"{_ratios_text(engine, siblings + 1)} (interpolated between; a shape not measured takes the "
                       f"largest) to match the engine's steps measured here, plus {extra.step * 1e3:.1f} ms per step "
                       f"for the optimizer's update of the whole model")
        on = f"cpu ({threads} thread{plural} per rank{beside})" if device == "cpu" else \
            f"{device} ({torch.cuda.get_device_name()}, one GPU)"
        alone_note = (f"; a rank alone computes x{speedup:.2f} as fast as beside the others (measured), which the "
                      f"simulator gives the ranks still busy while others wait" if siblings else "")
        note = (f"measured on {on} at micro-batches of {sizes_text} "
                f"examples of {where}, affine in between; {engine_note}{alone_note}")
        model = Model(costs, figs, bytes_per_param, batch, least, extra.action, extra.step, data, speedup,
                      calibrate.by_shape(engine.replicated, engine.staged))
        return Inputs(model, note, memory_note, engine.drift, {**loads, "the engine's steps": engine.load})
    rate, per_call = sizing.layer_rate(machine, kind)
    note = (f"estimated from FLOPs at this machine's measured {flop_rate(machine.flops_per_s)} per rank "
            f"({machine.kind}; --tflops for other devices)")
    costs = estimated_costs(spec.layer_names, flops, figs, rate, per_call)
    return Inputs(Model(costs, figs, bytes_per_param, batch, least), note, memory_note,
                  loads={contention.RATE: machine.load})
