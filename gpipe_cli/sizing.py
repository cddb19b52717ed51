"""Which model a command measures on this machine: the paper's where it fits, else the same architecture smaller.

`gpipe bench` and `gpipe profile-memory` without model flags measure the paper's model of the family
(Transformer-L-48, AmoebaNet-D (18, 256)) when the devices' memory holds it and the command would
finish in about a minute; otherwise they walk down a ladder of the same architecture, fewer
layers and narrower, to the first member that does. Time is estimated from the model's FLOPs at a
quick measured rate of this machine (a matrix product on one rank's threads) times the share of it
the family's layers reach, plus the fixed costs
of starting ranks and of running a layer (a tiny block's forward and backward, also measured);
memory from the parameters and the activations' shapes. Every member keeps at least eight pipeline
layers, so that K=8 stays possible.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe_cli.models.describe import describe
from gpipe_cli.models.registry import build_model, resolve_preset
from gpipe_cli.units import human_bytes, human_seconds

# A command typed without a model should answer in about a minute (its estimate is within a factor of two).
TIME_BUDGET_S = 60.0
# Leave room for the rest of the machine: a model may use at most this share of the free memory.
MEMORY_SHARE = 0.5

# The paper's models, then the same architecture scaled down, largest first.
_TRANSFORMER_SMALL: list[dict[str, Any]] = [
    dict(layers=24, d_model=1024, ff=4096, heads=16, vocab_size=32000, max_len=256),
    dict(layers=12, d_model=768, ff=3072, heads=12, vocab_size=32000, max_len=256),
    dict(layers=8, d_model=512, ff=2048, heads=8, vocab_size=16000, max_len=128),
    dict(layers=8, d_model=256, ff=1024, heads=4, vocab_size=8000, max_len=64),
    dict(layers=8, d_model=128, ff=512, heads=4, vocab_size=2000, max_len=32),
    dict(layers=8, d_model=64, ff=256, heads=2, vocab_size=512, max_len=16),
    dict(layers=8, d_model=32, ff=128, heads=2, vocab_size=256, max_len=8),
]
_AMOEBANET_SMALL: list[dict[str, Any]] = [
    dict(layers=18, filters=128, image_size=224, num_classes=1000),
    dict(layers=12, filters=64, image_size=128, num_classes=1000),
    dict(layers=6, filters=32, image_size=64, num_classes=100),
    dict(layers=6, filters=16, image_size=32, num_classes=10),
    dict(layers=6, filters=8, image_size=32, num_classes=10),
]
LADDERS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "transformer": ("transformer-l-48", _TRANSFORMER_SMALL),
    "amoebanet": ("amoebanet-d-18-256", _AMOEBANET_SMALL),
}
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

    @property
    def label(self) -> str:
        """e.g. "2 CPU cores" or "1 GPU"."""
        name = "GPU" if self.kind == "cuda" else "CPU core"
        return f"{self.units} {name}{'s' if self.units != 1 else ''}"


def measured_rate(device: str = "cpu", threads: int = 1, seconds: float = 0.2) -> float:
    """FLOP/s of a matrix product on `device` with `threads` intra-op threads (a quick calibration)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024 if device == "cuda" else 256
        a, b = torch.randn(n, 2 * n, device=device), torch.randn(2 * n, 2 * n, device=device)
        for _ in range(3):
            a @ b  # warm-up: allocator and kernel selection
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        if device == "cuda":
            torch.cuda.synchronize()
        return count * 2 * n * (2 * n) * (2 * n) / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)


def measured_call(device: str = "cpu", threads: int = 1, seconds: float = 0.1) -> float:
    """Seconds of a forward and backward through a tiny residual block: the fixed cost of running a layer."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 32)).to(device)
        x = torch.randn(4, 8, 32, device=device, requires_grad=True)

        def call() -> None:
            (block(x) + x).sum().backward()

        for _ in range(3):
            call()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call()
            count += 1
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / count
    finally:
        torch.set_num_threads(previous)


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def this_machine(threads: int = 1) -> Machine:
    """This machine's devices, their free memory and a measured rate."""
    from gpipe_cli.memory_model import available_bytes

    if torch.cuda.is_available():
        return Machine("cuda", torch.cuda.device_count(), float(available_bytes("cuda")), measured_rate("cuda"),
                       measured_call("cuda"))
    cores = usable_cores()
    # Measured on one thread (threads that share busy cores make a quick measurement meaningless), then
    # scaled: large products use a rank's threads, small layers' fixed costs do not shrink with them.
    return Machine("cpu", cores, float(available_bytes("cpu")), measured_rate("cpu", 1) * min(threads, cores),
                   measured_call("cpu", 1))


@dataclass(frozen=True)
class Candidate:
    """A model the command could measure, with what sizing needs to know of it."""

    kind: str
    params: dict[str, Any]
    parameters: int
    flops: float             # forward FLOPs per example
    pipeline_layers: int
    output_bytes: float      # per example, summed over layers (activations scale with it)
    input_bytes: float       # per example

    def describe(self, full: bool = False) -> str:
        """How the model is named to the user."""
        return describe_params(self.kind, self.params, full)


def describe_params(kind: str, params: dict[str, Any], full: bool = False) -> str:
    """e.g. "Transformer-L with 8 layers, d_model 512" or "AmoebaNet-D (6, 32) at 64 px" (`full`: every size)."""
    if kind == "transformer":
        name = f"Transformer-L with {params.get('layers')} layers, d_model {params.get('d_model')}"
        return name + (f" (feed-forward {params.get('ff')}, {params.get('heads')} heads, sequence "
                       f"{params.get('max_len', 256)}, vocabulary {params.get('vocab_size')})" if full else "")
    name = f"AmoebaNet-{str(params.get('variant', 'd')).upper()} ({params.get('layers')}, {params.get('filters')})"
    return name + f" at {params.get('image_size', 224)} px" + (
        f", {params.get('num_classes', 1000)} classes" if full else "")


# Depths at which a family is described to price deeper members: parameters, FLOPs and activations grow
# linearly with the layers (Transformer layers are alike; AmoebaNet adds the same cells to each stack).
_PROBE_DEPTHS = {"transformer": (1, 2), "amoebanet": (3, 6)}


@functools.lru_cache(maxsize=64)
def _described(kind: str, frozen: tuple[tuple[str, Any], ...], microbatch: int) -> tuple[float, float, float, float]:
    summary = describe(build_model(kind, **dict(frozen)), microbatch)  # on the meta device: shapes only
    return (float(summary.total_params), float(summary.total_flops),
            float(sum(c.activation_bytes for c in summary.layers)), float(summary.input_bytes))


@functools.lru_cache(maxsize=64)
def _candidate(kind: str, frozen: tuple[tuple[str, Any], ...], microbatch: int) -> Candidate:
    params = dict(frozen)
    layers = len(build_model(kind, **params).layers)
    depth = params.get("layers")
    probes = _PROBE_DEPTHS.get(kind)
    if probes is not None and isinstance(depth, int) and depth > probes[1]:
        # Describing a paper-sized model on the meta device takes seconds; two shallow members price it.
        lo, hi = (_described(kind, tuple(sorted({**params, "layers": d}.items())), microbatch) for d in probes)
        t = (depth - probes[0]) / (probes[1] - probes[0])
        figures = tuple(a + (b - a) * t for a, b in zip(lo, hi))
    else:
        figures = _described(kind, frozen, microbatch)
    total, flops, output, inputs = figures
    return Candidate(kind, params, round(total), flops, layers, output, inputs)


def candidate(kind: str, params: dict[str, Any], microbatch: int = 2) -> Candidate:
    """The figures sizing reads of one model (per example, described at a micro-batch of `microbatch`)."""
    # Two examples at least: BatchNorm refuses a single value per channel.
    return _candidate(kind, tuple(sorted(params.items())), max(microbatch, 2))


def ladder(family: str, settings: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The family's members, the paper's first: (kind, build parameters), each with `settings` applied."""
    preset, smaller = LADDERS[family]
    kind, paper = resolve_preset(preset)
    extra = settings or {}
    return [(kind, {**paper, **extra})] + [(kind, {**paper, **small, **extra}) for small in smaller]


def keeps_size(family: str, settings: dict[str, Any]) -> bool:
    """Whether model `settings` leave every member of `family` its size: training-only settings, and values the
    members have already (`arch=decoder-only` for the Transformer-L)."""
    members = [params for _, params in ladder(family)]
    return all(key in TRAINING_ONLY or all(key in params and params[key] == value for params in members)
               for key, value in settings.items())


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate fits memory and time, with its estimates."""

    need_bytes: float
    have_bytes: float
    seconds: float
    budget_s: float

    @property
    def fits(self) -> bool:
        """Whether both fit."""
        return self.need_bytes <= self.have_bytes and self.seconds <= self.budget_s

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
    note: str = ""                         # the one-line announcement when scaled ('' otherwise)
    verdict: Verdict | None = None
    rejected: list[str] = field(default_factory=list)


def _pipeline_layers(kind: str, params: dict[str, Any], layers: int) -> int:
    """How many pipeline layers the model has with `layers` layers (a spec only: layers are built lazily)."""
    return len(build_model(kind, **{**params, "layers": layers}).layers)


def deep_enough(kind: str, params: dict[str, Any], stages: int) -> dict[str, Any]:
    """`params` deepened, a stack at a time, just enough that `stages` stages get one pipeline layer each."""
    step = 3 if kind == "amoebanet" else 1  # AmoebaNet's normal cells come in three stacks
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
           settings: dict[str, Any] | None = None) -> Choice:
    """The paper's member of `family` if `judge` says it fits, else the largest smaller member that does
    (each deep enough for `stages` stages, and with model `settings` that `keeps_size`)."""
    members = [(kind, deep_enough(kind, params, stages)) for kind, params in ladder(family, settings)]
    rejected: list[str] = []
    first_reason = ""
    for index, (kind, params) in enumerate(members):
        cand = candidate(kind, params)
        verdict = judge(cand)
        if verdict.fits:
            if index == 0:
                return Choice(kind, params, False, "", verdict)
            note = (f"measuring {cand.describe()}: {first_reason}; choose with --model/--layers")
            return Choice(kind, params, True, note, verdict, rejected)
        what = _short(kind, params) if index else f"the paper's {_short(kind, params)}"
        reason = verdict.why_not(what)
        first_reason = first_reason or reason
        rejected.append(reason)
    kind, params = members[-1]
    cand = candidate(kind, params)
    note = f"measuring {cand.describe()}, the smallest member: {first_reason}; choose with --model/--layers"
    return Choice(kind, params, True, note, judge(cand), rejected)


def _short(kind: str, params: dict[str, Any]) -> str:
    if kind == "transformer":
        return f"{params.get('layers')}-layer model"
    return f"AmoebaNet-D ({params.get('layers')}, {params.get('filters')})"


# A model's whole layers run at this share of the bare matrix product `measured_rate` times, on top of
# the fixed cost per layer call. Measured on a 2-core CPU, one thread per rank, from K=1 bench steps: a
# Transformer's large products run at about that rate (0.5 at d_model 128 to 1.6 at 512), AmoebaNet's
# separable convolutions at a twentieth. Anything else, and every GPU, is guessed.
_EFFICIENCY = {("cpu", "transformer"): 0.8, ("cpu", "amoebanet"): 0.06}


def layer_efficiency(device: str, kind: str) -> float:
    """The share of the measured matrix-product rate that model family `kind`'s layers reach on `device`."""
    return _EFFICIENCY.get((device, kind), 0.3 if device == "cuda" else 0.1)


def passes(checkpoint: str) -> float:
    """A training step's work in forwards: the forward, a backward of two, and a recompute unless `never`."""
    return 3.0 if checkpoint == "never" else 4.0


def step_seconds(cand: Candidate, machine: Machine, examples: int, microbatches: int, passes: float) -> float:
    """Estimated seconds of one training step's compute on one rank: FLOPs at the measured rate plus
    the fixed cost of every layer call (which dominates small models)."""
    efficiency = layer_efficiency(machine.kind, cand.kind)
    # A pipeline layer runs several small blocks' worth of operators (attention, two norms, a feed-forward).
    per_call = 1.5 * machine.call_seconds
    flops = examples * cand.flops * passes
    return flops / (machine.flops_per_s * efficiency) + microbatches * cand.pipeline_layers * passes * per_call


def activation_bytes(cand: Candidate, examples: float) -> float:
    """A rough bound on the activations a forward of `examples` keeps (several tensors per layer output)."""
    return examples * (6 * cand.output_bytes + cand.input_bytes)


def launch_seconds(ranks: int, machine: Machine) -> float:
    """Starting `ranks` ranks: the launcher, then every rank importing torch and joining the group."""
    return 6.0 + 4.0 * ranks / max(min(machine.units, ranks), 1)


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up."""
    return -(-a // b) if b else 0
