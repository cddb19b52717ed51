"""Which model a command measures on this machine: the paper's where it fits, else the same architecture smaller."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe_cli.contention import Load, usable_cores
from gpipe_cli.estimate import kept
from gpipe_cli.models import families
from gpipe_cli.models.registry import build_model, resolve_preset
from gpipe_cli.units import human_bytes, human_seconds

# A command typed without a model should answer in about a minute (its estimate is within a factor of two).
TIME_BUDGET_S = 60.0
# Leave room for the rest of the machine: a model may use at most this share of the free memory.
MEMORY_SHARE = 0.5

# Model settings that change how a model trains but none of its weights' or activations' shapes: `--set` of
# one of them still leaves the model to be sized to the machine, each member taking the setting.
TRAINING_ONLY = ("dropout", "label_smoothing", "scaled_init", "logit_clip")


@dataclass(frozen=True)
class Machine:
    """What a command can use: the device kind, how many, their memory and one rank's measured speed."""

    kind: str              # "cpu" or "cuda"
    units: int             # CPU cores or GPUs
    memory_bytes: float    # free RAM (CPU, shared by all ranks) or free memory of one GPU
    flops_per_s: float     # one rank's measured rate (one thread, or one GPU)
    call_seconds: float    # one rank's measured cost of a small layer's forward and backward
    # What else used this machine's CPU while the rate was measured (contention.Load; {}: not read)
    load: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the body with `threads` intra-op threads, and the previous count again after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _calls_per_s(call: Callable[[], Any], device: str, threads: int, seconds: float, fastest: bool = False) -> float:
    """How many times a second `call` runs on `device` with `threads` intra-op threads, after three untimed."""
    # `fastest`: at the rate of the fastest call (a CPU's peak, which other processes on its cores cannot lower);
    # else the mean, which they do lower, as they will lower the work a time estimate is for.
    with torch_threads(threads):
        for _ in range(3):
            call()  # warm-up: allocator and kernel selection
        best, count, start = float("inf"), 0, time.perf_counter()
        while (begun := time.perf_counter()) - start < seconds:
            call()
            count += 1
            if fastest:
                best = min(best, time.perf_counter() - begun)
        if device == "cuda":
            torch.cuda.synchronize()
        return 1 / best if fastest else count / (time.perf_counter() - start)


def _own_rng(device: str) -> contextlib.AbstractContextManager[Any]:
    """Random numbers drawn for a timing only: torch's generators are left as they were (a checkpoint keeps them)."""
    return torch.random.fork_rng(devices=[torch.device(device)] if device == "cuda" else [])


def measured_rate(device: str = "cpu", threads: int = 1, seconds: float = 0.2, fastest: bool = False) -> float:
    """FLOP/s of a matrix product on `device` with `threads` intra-op threads (a quick calibration; see `fastest`)."""
    n = 1024 if device == "cuda" else 256
    with _own_rng(device):
        a, b = torch.randn(n, 2 * n, device=device), torch.randn(2 * n, 2 * n, device=device)
    return _calls_per_s(lambda: a @ b, device, threads, seconds, fastest) * 2 * n * (2 * n) * (2 * n)


def measured_call(device: str = "cpu", threads: int = 1, seconds: float = 0.1) -> float:
    """Seconds of a forward and backward through a tiny residual block: the fixed cost of running a layer."""
    with _own_rng(device):
        block = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 32)).to(device)
        x = torch.randn(4, 8, 32, device=device, requires_grad=True)
    return 1 / _calls_per_s(lambda: (block(x) + x).sum().backward(), device, threads, seconds)


def this_machine(threads: int = 1) -> Machine:
    """This machine's devices, their free memory and a measured rate."""
    from gpipe_cli.memory_model import available_bytes

    if torch.cuda.is_available():
        return Machine("cuda", torch.cuda.device_count(), float(available_bytes("cuda")), measured_rate("cuda"),
                       measured_call("cuda"))
    cores = usable_cores()
    # Measured on one thread (threads that share busy cores make a quick measurement meaningless), then
    # scaled: large products use a rank's threads, small layers' fixed costs do not shrink with them.
    load = Load()
    rate, call = measured_rate("cpu", 1) * min(threads, cores), measured_call("cpu", 1)
    return Machine("cpu", cores, float(available_bytes("cpu")), rate, call, load.finish())


@dataclass(frozen=True)
class Candidate:
    """A model the command could measure, with what sizing needs to know of it."""

    kind: str
    params: dict[str, Any]
    parameters: int
    flops: float             # forward FLOPs per example
    pipeline_layers: int

    def describe(self, full: bool = False) -> str:
        """How the model is named to the user."""
        return families.of(self.kind).title(self.params, full)


@functools.lru_cache(maxsize=64)
def _described(kind: str, frozen: tuple[tuple[str, Any], ...], microbatch: int) -> tuple[float, float]:
    summary = kept.summary(build_model(kind, **dict(frozen)), microbatch)  # on the meta device: shapes only
    return float(summary.total_params), float(summary.total_flops)


@functools.lru_cache(maxsize=64)
def _candidate(kind: str, frozen: tuple[tuple[str, Any], ...], microbatch: int) -> Candidate:
    params = dict(frozen)
    layers = len(build_model(kind, **params).layers)
    depth = params.get("layers")
    # Parameters and FLOPs grow linearly with the layers past the family's probe depths.
    probes = families.of(kind).probe_depths
    if isinstance(depth, int) and depth > probes[1]:
        # Describing a paper-sized model on the meta device takes seconds; two shallow members price it.
        lo, hi = (_described(kind, tuple(sorted({**params, "layers": d}.items())), microbatch) for d in probes)
        t = (depth - probes[0]) / (probes[1] - probes[0])
        figures = tuple(a + (b - a) * t for a, b in zip(lo, hi))
    else:
        figures = _described(kind, frozen, microbatch)
    total, flops = figures
    return Candidate(kind, params, round(total), flops, layers)


def candidate(kind: str, params: dict[str, Any], microbatch: int = 2) -> Candidate:
    """The figures sizing reads of one model (per example, described at a micro-batch of `microbatch`)."""
    # Two examples at least: BatchNorm refuses a single value per channel.
    return _candidate(kind, tuple(sorted(params.items())), max(microbatch, 2))


def ladder(name: str, settings: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The family's members, the paper's first: (kind, build parameters), each with `settings` applied."""
    facts = families.of(name)
    kind, paper = resolve_preset(facts.paper_preset)
    extra = settings or {}
    return [(kind, {**paper, **extra})] + [(kind, {**paper, **small, **extra}) for small in facts.smaller]


def keeps_size(family: str, settings: dict[str, Any]) -> bool:
    """Whether model `settings` leave every member of `family` its size: training-only ones, or values members have."""
    members = [params for _, params in ladder(family)]
    return all(key in TRAINING_ONLY or all(key in params and params[key] == value for params in members)
               for key, value in settings.items())


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate fits memory and time, with its estimates."""

    # Bytes, or what prices them when first asked: a model too slow to measure is never priced (`fits`).
    need: float | Callable[[], float]
    have_bytes: float
    seconds: float
    budget_s: float

    @functools.cached_property
    def need_bytes(self) -> float:
        """The memory it needs."""
        return self.need() if callable(self.need) else self.need

    @property
    def fits(self) -> bool:
        """Whether both fit."""
        return self.seconds <= self.budget_s and self.need_bytes <= self.have_bytes

    def why_not(self, what: str) -> str:
        """Why `what` does not fit, in a few words ('' when it does)."""
        if self.need_bytes > self.have_bytes:
            free = self.have_bytes / MEMORY_SHARE
            if self.need_bytes > free:
                return f"{what} needs {human_bytes(self.need_bytes)}, {human_bytes(free)} is free"
            return f"{what} needs {human_bytes(self.need_bytes)}, more than half of the {human_bytes(free)} free"
        if self.seconds > self.budget_s:
            return f"{what} would take about {human_seconds(self.seconds)} here"
        return ""


@dataclass
class Choice:
    """The model chosen, why, and its estimates."""

    kind: str
    params: dict[str, Any]
    scaled: bool
    note: str                              # the one-line announcement when scaled ('' otherwise)
    verdict: Verdict


def _pipeline_layers(kind: str, params: dict[str, Any], layers: int) -> int:
    """How many pipeline layers the model has with `layers` layers (a spec only: layers are built lazily)."""
    return len(build_model(kind, **{**params, "layers": layers}).layers)


def deep_enough(kind: str, params: dict[str, Any], stages: int) -> dict[str, Any]:
    """`params` deepened, a stack at a time, just enough that `stages` stages get one pipeline layer each."""
    step = families.of(kind).depth_step
    have = len(build_model(kind, **params).layers)
    if have >= stages:
        return dict(params)
    depth = int(params["layers"])
    # Pipeline layers grow linearly with `layers` (a fixed head and tail around repeated blocks): two
    # specs give the slope, so the depth is solved for rather than searched a stack at a time (K specs
    # of up to K layers each: quadratic, minutes for a large K).
    per_step = max(_pipeline_layers(kind, params, depth + step) - have, 1)
    depth += step * ceil_div(stages - have, per_step)
    while _pipeline_layers(kind, params, depth) < stages:  # a check: once, unless the growth was not linear
        depth += step
    return {**params, "layers": depth}


def choose(family: str, judge: Callable[[Candidate], Verdict], stages: int = 1,
           settings: dict[str, Any] | None = None, chunks: int = 1) -> Choice:
    """The paper's member of `family` if `judge` says it fits, else the largest smaller member that does (each deep
    enough for `stages` stages of `chunks` chunks)."""
    rungs = ladder(family, settings)
    members = [(kind, deep_enough(kind, params, stages * chunks)) for kind, params in rungs]
    paper = families.of(members[0][0]).short(rungs[0][1])
    if members[0][1] != rungs[0][1]:  # it was not the paper's own that was judged
        of = f" of {chunks} chunks" if chunks > 1 else ""
        paper = f"{paper}, deepened to {members[0][1].get('layers')} layers for {stages} stages{of},"
    cand = candidate(*members[0])
    verdict = judge(cand)
    if verdict.fits:
        return Choice(*members[0], False, "", verdict)
    reason = verdict.why_not(f"the paper's {paper}")
    # Each member is smaller than the one before it in every size, so needs less memory and time: the first that
    # fits is found by bisection (describing a member takes up to a second, each a different model).
    low, high, first, last = 1, len(members) - 1, None, (cand, verdict)
    while low <= high:
        middle = (low + high) // 2
        cand = candidate(*members[middle])
        verdict = judge(cand)
        if verdict.fits:
            first, high = (middle, cand, verdict), middle - 1
        else:
            low, last = middle + 1, (cand, verdict)  # all that fail: the smallest member is judged last
    if first is not None:
        index, cand, verdict = first
        return Choice(*members[index], True, f"measuring {cand.describe()}: {reason}; choose with --model/--layers",
                      verdict)
    cand, verdict = last
    note = f"measuring {cand.describe()}, the smallest member: {reason}; choose with --model/--layers"
    return Choice(*members[-1], True, note, verdict)


def layer_efficiency(device: str, kind: str) -> float:
    """The share of the measured matrix-product rate that model family `kind`'s layers reach on `device`."""
    # Measured on a 2-core CPU, one thread per rank, from K=1 bench steps; every GPU and other family is guessed.
    known = families.FAMILIES.get(kind)
    return 0.3 if device == "cuda" else known.cpu_efficiency if known else 0.1


def passes(checkpoint: str) -> float:
    """A training step's work in forwards: the forward, a backward of two, and a recompute unless `never`."""
    return 3.0 if checkpoint == "never" else 4.0


def layer_rate(machine: Machine, kind: str) -> tuple[float, float]:
    """The effective FLOP/s of model family `kind`'s layers on `machine`, and the fixed seconds of a layer call."""
    # A pipeline layer runs several small blocks' worth of operators (attention, two norms, a feed-forward).
    return machine.flops_per_s * layer_efficiency(machine.kind, kind), 1.5 * machine.call_seconds


def step_seconds(cand: Candidate, machine: Machine, examples: int, microbatches: int, passes: float) -> float:
    """Estimated seconds of a step's compute on a rank: FLOPs at the measured rate plus a fixed cost per layer call."""
    rate, per_call = layer_rate(machine, cand.kind)
    return examples * cand.flops * passes / rate + microbatches * cand.pipeline_layers * passes * per_call


# Ranks forked from a server that imports torch once, on CPUs (2-core CPU: the first launch 3.6 to 4.5 s, server
# included, for a model of 0.1M parameters; the next, of 2 ranks, 0.35 s). A GPU rank's CUDA start is not measured.
FORKED_FIRST_S, FORKED_RANK_S = 3.5, 0.2


def launch_seconds(ranks: int, machine: Machine, first: bool = True, forking: bool = False) -> float:
    """Starting `ranks` ranks: the launcher, every rank importing torch (`forking`: a server's, once) and joining."""
    # Starting is the host's work, ranks sharing a GPU too: on an H200 with 16 cores, K=8 on its one GPU started as
    # one wave (bench's estimate, counting a wave per GPU, was 1.8 min; the run took 0.7).
    cores = machine.units if machine.kind == "cpu" else usable_cores()
    waves = ranks / max(min(cores, ranks), 1)
    if forking and machine.kind == "cpu":
        return (FORKED_FIRST_S if first else 0.0) + FORKED_RANK_S * waves
    return 6.0 + 4.0 * waves


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up."""
    return -(-a // b) if b else 0
