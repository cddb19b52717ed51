"""Predict a pipeline's step time for devices that are not here, from measured per-layer costs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.pipeline import microbatch, partition, placement, schedules
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.schedule import Action, Kind, Rate, Span

# The share of a layer's backward that is the input gradient: for a matrix product, one of its two
# products of equal size (the other is the weight gradient). Only the whole backward is measured.
INPUT_SHARE = 0.5
BACKWARD_SHARES = {Kind.BWD: 1.0, Kind.BWD_INPUT: INPUT_SHARE, Kind.BWD_WEIGHT: 1.0 - INPUT_SHARE}


@dataclass(frozen=True)
class Link:
    """The simulated interconnect between neighbouring stages."""

    bandwidth: float  # bytes per second
    latency: float    # seconds per message

    @staticmethod
    def of(gb_per_s: float, latency_us: float) -> Link:
        """A link from the command's units."""
        return Link(gb_per_s * 1e9, latency_us * 1e-6)


FREE = Link(1e30, 0.0)  # messages cost nothing: compute alone


def rate_model(alone_speedup: float, stages: int, replicas: int = 1) -> Rate:
    """Speed with `busy` of the ranks computing: `alone_speedup` for one of all, 1 for all, linear in between."""
    # In fill and drain fewer ranks share the cores; a pipeline's replicas compute in step.
    ranks = stages * replicas

    def rate(busy: int) -> float:
        if ranks <= 1:
            return 1.0
        idle_share = (ranks - busy * replicas) / (ranks - 1)
        return 1.0 + (alone_speedup - 1.0) * max(idle_share, 0.0)
    return rate


@dataclass(frozen=True)
class Prediction:
    """A simulated step: its time, throughput and bubble, and every action's span."""

    partitions: int
    microbatches: int
    batch_size: int
    balance: list[int]
    step_time: float
    bubble: float
    calibration: float
    spans: list[list[Span]]

    @property
    def samples_per_s(self) -> float:
        """Predicted examples per second."""
        return self.batch_size / self.step_time if self.step_time > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The figures (not the spans) as plain data."""
        return {"partitions": self.partitions, "microbatches": self.microbatches, "batch_size": self.batch_size,
                "balance": self.balance, "step_time": self.step_time, "samples_per_s": self.samples_per_s,
                "bubble": self.bubble, "calibration": self.calibration}


def simulate_step(costs: CostProfile, balance: list[int], batch_size: int, microbatches: int, schedule: str,
                  checkpoint: str, link: Link, scale: float = 1.0, virtual: int = 1,
                  overhead: float = 0.0, rate: Rate | None = None) -> Prediction:
    """The simulated step of `balance` (K x V chunks, K = its length / V) with M micro-batches."""
    # `overhead`: the engine's own seconds per layer of a compute action beyond its measured time; `rate`: how
    # much faster compute runs with fewer ranks busy, for ranks sharing cores.
    stages = len(balance) // virtual
    ranges = partition.stage_ranges(balance)  # one per chunk
    last = len(balance) - 1
    per_example = [size / costs.microbatch_size for size in microbatch.sizes(batch_size, microbatches)]

    @functools.cache  # a chunk's seconds of one kind of work, summed once per simulation
    def seconds(chunk: int, kind: Kind, remat: bool) -> float:
        layers, loss = [costs.layers[i] for i in ranges[chunk]], costs.loss if chunk == last else 0.0
        if kind == Kind.FWD:
            return sum(t.forward_nograd if remat else t.forward for t in layers) + loss
        if kind == Kind.RECOMPUTE:
            return sum(t.recompute_seconds for t in layers)
        return sum(t.backward for t in layers) * BACKWARD_SHARES[kind]

    def cost(stage: int, action: Action) -> float:
        if action.kind not in sched.COMPUTE:
            return 0.0
        return seconds(action.chunk, action.kind, action.remat) * scale * per_example[action.microbatch] + \
            overhead * len(ranges[action.chunk])

    def latency(stage: int, action: Action) -> float:
        # A forward message carries this stage's output; a backward one the gradient of its input.
        chunk = ranges[action.chunk]
        boundary = chunk.stop - 1 if action.kind == Kind.SEND_FWD else chunk.start - 1
        nbytes = costs.layers[boundary].output_bytes if boundary >= 0 else costs.input_bytes
        return link.latency + nbytes * per_example[action.microbatch] / link.bandwidth

    lists = sched.build_all(schedule, stages, microbatches, checkpoint, virtual)
    spans = sched.simulate(lists, cost, latency, schedules.get(schedule).placement, rate)
    step = max(span.end for stage in spans for span in stage)
    return Prediction(stages, microbatches, batch_size, list(balance), step, sched.bubble(spans), scale, spans)


def predict(costs: CostProfile, devices: int, batch_size: int, microbatches: int, schedule: str, checkpoint: str,
            link: Link, measured_k1_step: float | None = None, balance: list[int] | None = None,
            virtual: int = 1) -> Prediction:
    """Predict K=`devices` with V=`virtual` chunks each (balanced by the measured costs unless `balance` is given)."""
    partition.check_partitions(len(costs.layers), devices * virtual)
    shape = schedules.get(schedule).placement
    balance = balance or costs.balance(devices * virtual, checkpoint, placement.cut_owners(devices, virtual, shape),
                                       microbatches)
    scale = 1.0
    if measured_k1_step and measured_k1_step > 0:
        # Per-layer timings miss the engine's own per-step work, so they are scaled until the simulated single-device
        # step lasts as long as the measured one (a V-shaped schedule runs its two chunks on the one device).
        alone_virtual = 2 if shape == "v" else 1
        cut = costs.balance(alone_virtual, checkpoint) if alone_virtual > 1 else [len(costs.layers)]
        alone = simulate_step(costs, cut, batch_size, microbatches, schedule, checkpoint, Link(1.0, 0.0),
                              virtual=alone_virtual)
        scale = measured_k1_step / alone.step_time if alone.step_time > 0 else 1.0
    return simulate_step(costs, balance, batch_size, microbatches, schedule, checkpoint, link, scale, virtual)


def replayed(costs: CostProfile, prediction: Prediction, stage_busy: list[float], schedule: str, checkpoint: str,
             link: Link, virtual: int = 1) -> Prediction:
    """`prediction` simulated again with each stage computing for its measured `stage_busy` seconds a step."""
    # Splits a miss in two: the stages' compute (this host's speed, which drifts between runs) and the schedule
    # (order, dependencies, messages), which is what the simulator models.
    ranges, ratios = partition.stage_ranges(prediction.balance), [1.0] * len(costs.layers)
    for stage, spans in enumerate(prediction.spans):
        simulated = sched.seconds(spans)
        for chunk in {span.action.chunk for span in spans}:
            for layer in ranges[chunk]:
                ratios[layer] = stage_busy[stage] / simulated if simulated > 0 else 1.0
    return simulate_step(costs.scaled(ratios), prediction.balance, prediction.batch_size, prediction.microbatches,
                         schedule, checkpoint, link, prediction.calibration, virtual)
