"""Search K, D, M, schedule, remat mode, offload and balance for the fastest pipeline that fits: predictions only."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate import simulate
from gpipe_cli.estimate.costs import CostProfile
from gpipe_cli.memory_model import ModelFigures
from gpipe_cli.pipeline import partition, schedules
from gpipe_cli.pipeline.schedule import REMAT_MODES, SCHEDULES, build_all, rematerialised

VIRTUAL_STAGES = (2, 4)   # V tried for the interleaved schedule


@dataclass(frozen=True)
class Hardware:
    """The devices planned for: how many, on how many nodes, each one's memory, and the links between them."""

    devices: int
    memory: float                    # bytes per device
    link: simulate.Link              # between devices of one node
    node_link: simulate.Link         # between nodes
    nodes: int = 1
    reduce_link: simulate.Link | None = None  # per hop of a ring all-reduce within a node (None: `link`)


# (micro-batch size, K, D, V, schedule) -> how much slower the engine runs the layers than they were timed
Factor = Callable[[int, int, int, int, str], float]


@dataclass(frozen=True)
class Model:
    """What the search knows of a model: per-layer seconds at any micro-batch size and memory figures."""

    costs: Callable[[int], CostProfile]  # per-layer seconds of one micro-batch of that many examples, as timed
    figures: ModelFigures
    bytes_per_param: float
    batch: int                           # the global mini-batch
    min_microbatch: int = 1              # 2 where BatchNorm needs two examples per micro-batch
    action_overhead: float = 0.0         # seconds the engine adds to every layer of a compute action
    step_overhead: float = 0.0           # seconds the engine adds per step on one stage (optimizer, ...)
    data_seconds: float = 0.0            # building one global mini-batch; each replica builds its share
    alone_speedup: float = 1.0           # how much faster a rank computes alone than with every rank busy
    # The engine's measured steps over the simulated ones, by shape: scales `costs` (default: as timed).
    factor: Factor = lambda *shape: 1.0

    def profile(self, config: Config) -> CostProfile:
        """Per-layer seconds of one of `config`'s micro-batches, as the engine runs them in that shape."""
        size = max(self.batch // config.replicas // config.microbatches, 1)
        ratio = self.factor(size, config.partitions, config.replicas, config.virtual, config.schedule)
        return self.costs(size).scaled(ratio)

    def rate(self, config: Config) -> simulate.Rate | None:
        """The compute speed with some ranks idle, for ranks that share this machine's cores (None: they do not)."""
        if self.alone_speedup == 1.0:
            return None
        return simulate.rate_model(self.alone_speedup, config.partitions, config.replicas)

    @property
    def layers(self) -> int:
        """Pipeline layers."""
        return len(self.figures.layers)


@dataclass(frozen=True)
class Config:
    """One way to run the model on the devices."""

    partitions: int   # K
    replicas: int     # D
    microbatches: int  # M
    schedule: str
    virtual: int      # V (interleaved), else 1
    checkpoint: str
    offload: str = "none"  # pipeline.offload: none, or activations (stored activations in host memory)

    def recomputation(self) -> int:
        """How much it recomputes: 0 nothing, 1 some forwards (except_last), 2 every forward (always)."""
        if self.checkpoint in ("always", "never"):
            return 2 if self.checkpoint == "always" else 0
        # except_last recomputes nothing where each forward is followed at once by its backward (one micro-batch,
        # or 1F1B on one stage): the schedule's action lists say which.
        lists = build_all(self.schedule, self.partitions, self.microbatches, self.checkpoint, self.virtual)
        return 1 if any(rematerialised(actions) for actions in lists) else 0

    def label(self) -> str:
        """e.g. 'K=2 D=1 M=8 interleaved V=2 except_last'."""
        sched = f"{self.schedule} V={self.virtual}" if self.virtual > 1 else self.schedule
        moved = " offload activations" if self.offload != "none" else ""
        return f"K={self.partitions} D={self.replicas} M={self.microbatches} {sched} {self.checkpoint}{moved}"


@dataclass
class Outcome:
    """A configuration's predicted figures, or why it cannot run."""

    config: Config
    balance: list[int]
    memory: list[float]            # predicted peak bytes per stage
    fits: bool
    step_time: float = math.inf
    bubble: float = 1.0
    allreduce: float = 0.0         # seconds of the gradient all-reduce after the pipeline's step
    fixed: float = 0.0             # the engine's per-step seconds (optimizer and the rest), busiest stage
    batch: int = 0

    @property
    def samples_per_s(self) -> float:
        """Predicted examples per second over all replicas."""
        return self.batch / self.step_time if self.step_time > 0 and math.isfinite(self.step_time) else 0.0

    @property
    def peak(self) -> float:
        """The fullest stage's bytes."""
        return max(self.memory) if self.memory else 0.0


@dataclass
class Result:
    """Every configuration evaluated, the fitting ones fastest first (the winner, of a tie, ahead)."""

    ranked: list[Outcome]          # fitting, fastest first, but the winner of a tie with the fastest first
    refused: list[Outcome]         # not fitting (unconstrained min-max cut), fastest first
    smallest_memory: float | None = None  # when nothing fits: the least memory per device a plan needs
    smallest: Outcome | None = None

    @property
    def best(self) -> Outcome | None:
        """The winner, or None when nothing fits."""
        return self.ranked[0] if self.ranked else None


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes(model: Model, hw: Hardware) -> Iterator[tuple[int, int, int, str, int]]:
    """Every (K, D, M, schedule, V) that uses all the devices: K | N, K <= layers, the batch split evenly over D, M."""
    for k in divisors(hw.devices):
        d = hw.devices // k
        if k > model.layers or model.batch % d:
            continue
        per_replica = model.batch // d
        for m in divisors(per_replica):
            if per_replica // m < model.min_microbatch:
                continue
            for name in SCHEDULES:
                for v in _virtual(name, k, m, model.layers):
                    yield k, d, m, name, v


def configs(model: Model, hw: Hardware) -> Iterator[Config]:
    """Every configuration that uses all the devices: each shape with every remat mode, offloading or not."""
    for k, d, m, name, v in shapes(model, hw):
        for mode in REMAT_MODES:
            # Its host copies are priced at no time (docs/planning.md): without rematerialization
            # offload would be priced as fast as keeping every graph on the device, which it is not.
            kept = Config(k, d, m, name, v, mode)
            yield kept
            if kept.recomputation():
                yield replace(kept, offload="activations")


def _virtual(name: str, k: int, m: int, layers: int) -> list[int]:
    if schedules.get(name).placement == "v":
        # A V is exactly two chunks per stage; on one stage it is the model cut in two for nothing.
        return [2] if k >= 2 and 2 * k <= layers else []
    if not schedules.get(name).chunked:
        return [1]
    # V=1 interleaved is 1F1B: listed once, under its own name.
    return [v for v in VIRTUAL_STAGES if k >= 2 and k * v <= layers and m % k == 0]


def _memory(model: Model, config: Config, capacity: float = math.inf) -> mm.CutMemory:
    """The bytes every stage needs under `config`, by its cut."""
    return mm.CutMemory(model.figures, config.partitions, model.batch // config.replicas, config.microbatches,
                        config.schedule, config.checkpoint, model.bytes_per_param, capacity, offload=config.offload)


def spans_nodes(hw: Hardware, partitions: int) -> bool:
    """Whether some pipeline has neighbouring stages on different nodes (rank = replica x K + stage)."""
    per_node = hw.devices // hw.nodes
    return any((r * partitions + s) // per_node != (r * partitions + s + 1) // per_node
               for r in range(hw.devices // partitions) for s in range(partitions - 1))


def allreduce_seconds(stage_params: Sequence[int], replicas: int, link: simulate.Link) -> float:
    """A ring all-reduce of each stage's fp32 gradients over the replicas; stages reduce at once, the slowest counts."""
    if replicas < 2 or not stage_params:
        return 0.0
    hops = 2 * (replicas - 1)
    return max(hops * link.latency + hops / replicas * mm.PARAM_BYTES * p / link.bandwidth for p in stage_params)


def evaluate(model: Model, hw: Hardware, config: Config, cut: Sequence[int] | None = None) -> Outcome:
    """The predicted step of one configuration, with the fitting min-max cut (else the unconstrained one) or `cut`."""
    per_replica = model.batch // config.replicas
    costs = model.profile(config)
    weights = costs.balance_costs(config.checkpoint)
    balance = list(cut) if cut is not None else partition.balance_by_cost(weights, config.partitions * config.virtual)
    priced = _memory(model, config, hw.memory)
    memory = priced.needs(balance)
    fits = max(memory) <= hw.memory
    if not fits and cut is None:
        within = priced.within(weights, config.virtual)
        if within is not None:
            balance, memory, fits = within, priced.needs(within), True
    link = hw.node_link if spans_nodes(hw, config.partitions) else hw.link
    prediction = simulate.simulate_step(costs, balance, per_replica, config.microbatches, config.schedule,
                                        config.checkpoint, link, 1.0, config.virtual, model.action_overhead,
                                        model.rate(config))
    placed = schedules.get(config.schedule).placement
    params = [sum(model.figures.layers[i].params for i in partition.stage_layers(balance, config.partitions, s, placed))
              for s in range(config.partitions)]
    reduce_link = hw.node_link if hw.nodes > 1 else hw.reduce_link or hw.link
    reduce = allreduce_seconds(params, config.replicas, reduce_link)
    # The engine's per-step seconds on the busiest stage, by its share of the parameters (the optimizer's work).
    total = sum(params)
    share = max(params) / total if total else 1.0 / len(params)
    fixed = model.step_overhead * share + model.data_seconds / config.replicas
    return Outcome(config, balance, memory, fits, prediction.step_time + reduce + fixed, prediction.bubble, reduce,
                   fixed, model.batch)


TIED = 0.005  # predicted throughputs this close are one: a plan's prediction is not finer


def _rank_key(outcome: Outcome) -> tuple[float, bool, float, int, int, int]:
    c = outcome.config
    return (-outcome.samples_per_s, c.offload != "none", outcome.peak, SCHEDULES.index(c.schedule), c.virtual,
            REMAT_MODES.index(c.checkpoint))


def min_max_memory(model: Model, config: Config, below: float = math.inf) -> tuple[float, list[int]] | None:
    """The least memory the fullest stage can need under `config`, if less than `below`."""
    weights = model.profile(config).balance_costs(config.checkpoint) if config.virtual > 1 else ()
    return _memory(model, config).least(weights, config.virtual, below)


# Searching takes about one of `sizing.measured_call`'s small layer calls per action of every shape (K x V chunks
# over M micro-batches each): building each shape's action lists, then simulating every remat mode on them and
# walking their memory. Measured on a loaded 2-core CPU, 0.4 to 1.0 for the quick start, AmoebaNet-D (cifar10) and
# the Transformer (wmt-en-de) on 2 to 8 devices: the long searches (20 to 35 s) near 1, the short ones under a second.
CALLS_PER_ACTION = 1.0


def search_seconds(model: Model, hw: Hardware, call_seconds: float) -> float:
    """About how long `search` takes here, at `call_seconds` per small layer call."""
    return CALLS_PER_ACTION * call_seconds * sum(k * v * m for k, _, m, _, v in shapes(model, hw))


def search(model: Model, hw: Hardware) -> Result:
    """Evaluate every configuration; the fitting ones fastest first, a tie's winner ahead (none fits: least memory)."""
    outcomes = [evaluate(model, hw, c) for c in configs(model, hw)]
    ranked = sorted((o for o in outcomes if o.fits), key=_rank_key)
    if ranked:  # within TIED of the fastest the prediction cannot tell them apart: the one needing least memory wins
        tied = [o for o in ranked if o.samples_per_s >= (1 - TIED) * ranked[0].samples_per_s]
        lean = min(tied, key=lambda o: (o.config.offload != "none", o.peak))
        ranked.insert(0, ranked.pop(ranked.index(lean)))
    refused = sorted((o for o in outcomes if not o.fits), key=_rank_key)
    result = Result(ranked, refused)
    if not ranked and refused:
        need, outcome = math.inf, refused[0]
        balance: list[int] = []
        for candidate in refused:  # the first of the least; each search prices only what could need less
            found = min_max_memory(model, candidate.config, need)
            if found is not None:
                (need, balance), outcome = found, candidate
        result.smallest_memory = need
        memory = _memory(model, outcome.config).needs(balance)
        result.smallest = replace(outcome, balance=balance, memory=memory)
    return result


def parts(model: Model, outcome: Outcome) -> dict[str, float]:
    """Split a predicted step into seconds of compute, bubble, messages and allreduce."""
    # compute: the mean per stage, the per-step work included.
    c = outcome.config
    free = simulate.simulate_step(model.profile(c), outcome.balance, model.batch // c.replicas, c.microbatches,
                                  c.schedule, c.checkpoint, simulate.FREE, 1.0, c.virtual, model.action_overhead,
                                  model.rate(c))
    pipeline = outcome.step_time - outcome.allreduce - outcome.fixed
    busy = free.step_time * (1.0 - free.bubble)
    return {"compute": busy + outcome.fixed, "bubble": free.step_time - busy,
            "messages": max(pipeline - free.step_time, 0.0), "allreduce": outcome.allreduce}

