"""The one memory model: what each stage of a pipeline holds, and what the device it runs on has."""

from __future__ import annotations

import functools
import itertools
import math
import operator
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import tie_groups
from gpipe_cli.pipeline import microbatch, partition, placement, schedules
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.layer_profile import profile_layers
from gpipe_cli.pipeline.offload import offloaded
from gpipe_cli.pipeline.schedule import Kind
from gpipe_cli.units import human_bytes, meminfo_available

# Activation bytes are affine in the batch (per-example tensors plus a few fixed ones such as masks and per-channel
# statistics), so two sizes give both parts. On the meta device only shapes exist: any model is priced at once.
PROBE_BATCHES = (2, 4)  # two examples at least: BatchNorm refuses a single value per channel

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    # The paper's AmoebaNet optimizer (12 bytes per parameter with the weight).
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9, momentum=0.9),
    "plain-sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "rmsprop-no-momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9),
}


@dataclass(frozen=True)
class Affine:
    """A byte count `fixed + per_example × examples`."""

    fixed: float
    per_example: float

    def at(self, examples: float) -> float:
        """The bytes for a micro-batch of `examples`."""
        return self.fixed + self.per_example * examples

    @staticmethod
    def through(x0: float, y0: float, x1: float, y1: float) -> Affine:
        """The affine function through two measured points."""
        slope = (y1 - y0) / (x1 - x0)
        return Affine(y0 - slope * x0, slope)

    def blend(self, other: Affine, t: float) -> Affine:
        """(1 - t) × self + t × other, coefficient-wise (extrapolates for t outside [0, 1])."""
        return Affine(self.fixed + (other.fixed - self.fixed) * t,
                      self.per_example + (other.per_example - self.per_example) * t)


ZERO = Affine(0.0, 0.0)


@dataclass(frozen=True)
class LayerFigures:
    """One layer: its parameters, the activations it saves (its input among them), the output it hands on."""

    name: str
    params: int
    saved: Affine
    output: Affine
    saved_input: Affine = ZERO   # the part of `saved` that is the layer's input


@dataclass(frozen=True)
class ModelFigures:
    """Every layer's figures plus the model input (the first stage's boundary); the loss is in the last layer."""

    input: Affine
    layers: tuple[LayerFigures, ...]
    ties: tuple[tuple[tuple[int, ...], int], ...] = ()  # tied groups: their layers, and parameters in one copy

    def params(self, chunks: Sequence[range]) -> int:
        """The parameters a stage of these layer ranges holds: a tied tensor once per stage, as the engine ties it."""
        total = sum(self.sums[2][r.stop] - self.sums[2][r.start] for r in chunks)
        if not self.ties:  # the common case, priced millions of times by a search
            return total
        for layers, numel in self.ties:
            held = sum(any(i in r for r in chunks) for i in layers)
            total -= max(held - 1, 0) * numel
        return total

    @functools.cached_property
    def sums(self) -> tuple[list[float], list[float], list[int]]:
        """Running sums of the layers' saved bytes (fixed, per example) and parameters: a stage's total in O(1)."""
        # A memory search prices millions of stages; byte counts and their halves add exactly in a float.
        fixed = [0.0, *itertools.accumulate(layer.saved.fixed for layer in self.layers)]
        per_example = [0.0, *itertools.accumulate(layer.saved.per_example for layer in self.layers)]
        return fixed, per_example, [0, *itertools.accumulate(layer.params for layer in self.layers)]

    @functools.cached_property
    def window_sums(self) -> dict[tuple[int, int], list[float]]:
        """Per micro-batch size and width, what that many neighbouring layers save from each layer on (as priced)."""
        return {}

    @functools.cached_property
    def kept(self) -> dict[tuple[int, int, int, bool], tuple[tuple[float, ...], ...]]:
        """Per chunk's bounds, micro-batch size and offload, what `_kept` found (filled as priced)."""
        return {}


def probe(spec: ModelSpec, examples: int, seed: int, device: str) -> tuple[int, list[tuple[int, int, int, int]]]:
    """Input bytes and per layer (params, saved, output, saved input) for one micro-batch of `examples`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inputs, targets = spec.example_batch(examples, device)
    # On the meta device the layers are built there too (shapes alone), so a layer larger than this machine's
    # memory is priced instead of failing to allocate its weights; only the building runs under the meta
    # context, which otherwise intercepts every operator of the forward (about half of its time).
    profile = profile_layers(spec.factories(), inputs, seed, device, repeats=0,
                             loss=lambda output: spec.loss(output, targets))
    rows = [(p.params, p.saved_bytes, p.output_bytes, p.saved_input_bytes) for p in profile]
    if profile.loss is not None and rows:
        # The loss's saved tensors belong to the last stage, and its input is the last layer's output.
        params, saved, output, saved_input = rows[-1]
        rows[-1] = (params, saved + profile.loss.saved_bytes, output, saved_input)
    return profile.input_bytes, rows


def measure(spec: ModelSpec, seed: int = 0, batches: Sequence[int] = PROBE_BATCHES,
            device: str = "cpu") -> ModelFigures:
    """Per-layer figures of `spec`, fitted from two micro-batch sizes (`device="meta"`: from shapes alone)."""
    (b0, b1) = batches
    in0, rows0 = probe(spec, b0, seed, device)
    in1, rows1 = probe(spec, b1, seed, device)
    layers = tuple(LayerFigures(name, r0[0], Affine.through(b0, r0[1], b1, r1[1]),
                                Affine.through(b0, r0[2], b1, r1[2]), Affine.through(b0, r0[3], b1, r1[3]))
                   for name, r0, r1 in zip(spec.layer_names, rows0, rows1))
    return ModelFigures(Affine.through(b0, in0, b1, in1), layers, tie_groups(spec))


def role(name: str) -> str:
    """The kind of layer a name denotes, equal for layers that are built alike whatever the depth."""
    # The first two normal cells of a stack (`cell_2_1`, `cell_2_2`) differ from the later ones, and so do their
    # layers: `cell_2_5.combine_3` is `cell_2_rest.combine_3`. All Transformer layers are alike: `layer_7` is `layer`.
    cell = re.fullmatch(r"cell_(\d+)_(\d+)(\..+)?", name)
    if cell:
        position = {"1": "first", "2": "second"}.get(cell.group(2), "rest")
        return f"cell_{cell.group(1)}_{position}{cell.group(3) or ''}"
    numbered = re.fullmatch(r"(layer|encoder|decoder)_\d+", name)
    return numbered.group(1) if numbered else name


PARAM_BYTES = 4  # an fp32 weight, and so its gradient


def primed(optimizer: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Optimizer `optimizer` over `params` with its state made now, by a step of zero gradients."""
    # A run past its first step holds that state through every forward and backward; one made after a step's
    # backward (as a first step does) never holds it beside the activations, so a peak measured then misses it.
    opt = OPTIMIZERS[optimizer](params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # zero gradients move no weight (but decoupled weight decay, by a factor of 1 - lr x decay)
    for p in params:
        p.grad = None
    return opt


@functools.lru_cache(maxsize=32)
def bytes_per_parameter(optimizer: str) -> float:
    """Weight, gradient and optimizer-state bytes per fp32 parameter, measured by one optimizer step."""
    param = nn.Parameter(torch.zeros(1024))
    param.grad = torch.zeros(1024)
    opt = OPTIMIZERS[optimizer]([param])
    opt.step()
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.numel() == param.numel())
    return 2 * PARAM_BYTES + state / param.numel()


@dataclass(frozen=True)
class Footprint:
    """Predicted bytes of one stage."""

    params: int
    weights_bytes: float   # parameters, gradients and optimizer state
    stored_bytes: float    # the most held from forwards when a backward-phase action starts
    peak_bytes: float      # the peak of the step
    layers: int = 0
    host_bytes: float = 0.0  # the most offloaded activations held in host memory at once (pipeline.offload)
    chunks: tuple[int, ...] = ()  # layers of each of its chunks, in chunk order
    # The last layer's output for one micro-batch, on the stage holding it: the loss's backward holds gradients of
    # its size (a language model's logits), which the saved-tensor accounting does not see.
    loss_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """What the device needs."""
        return self.weights_bytes + self.peak_bytes


# Per chunk, how a micro-batch it holds is kept: with its graph (whole), as its boundary input on the device
# (inputs) or in host memory (host), or with its saved tensors offloaded: waiting in host memory (parked), its
# last layer brought back ahead of its backward (fetched), a few layers on the device while its backward runs
# (active), or while a recompute's backward runs (redone: the recompute's last layer never went out), the same
# two while a split backward's B or W runs (split, split_redone), and a recompute's between its B and W (waiting).
KEPT = ("whole", "inputs", "host", "parked", "fetched", "active", "redone", "split", "split_redone", "waiting")
_ON_DEVICE = (0, 1, 3, 4, 5, 6, 7, 8, 9)  # positions in KEPT of what holds device memory
_IN_HOST = (2, 3, 4, 5, 6, 7, 8, 9)       # and host memory
# Under offload a forward holds two layers' saved tensors on the device (the one computing, the one going out),
# and so does a backward (the one it reaches, the one fetched ahead): autograd frees the layer above as its last
# node runs (pipeline/offload.py; measured to the byte on small models). A split backward retains its graph for
# W: the layer above stays until the backward reaches the one below (one more), and so does a recompute's last
# layer, until W.
WINDOW = 2


class _Tally:
    """Keys (micro-batch, chunk) held one way (`KEPT`), counted in a list shared by every way, in the key's block."""

    def __init__(self, counts: list[int], block: Callable[[tuple[int, int]], int], way: int) -> None:
        self.keys: set[tuple[int, int]] = set()
        self.counts, self.block, self.way = counts, block, way

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def add(self, key: tuple[int, int]) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self.counts[self.block(key) + self.way] += 1

    def discard(self, key: tuple[int, int]) -> None:
        if key in self.keys:
            self.keys.remove(key)
            self.counts[self.block(key) + self.way] -= 1


def _walk(schedule: str, stage: int, stages: int, microbatches: int, checkpoint: str, virtual: int,
          offload: str, larger: int = 0) -> set[tuple[int, tuple[int, ...]]]:
    """(kind, counts) per point of the walk: kind 0 a stored reading, 1 a peak; each chunk's `KEPT` counts in order."""
    # The first `larger` micro-batches hold one example more than the rest (`microbatch.sizes`): where there are
    # such, each chunk counts them apart, its larger ones' `KEPT` counts first.
    # A stage's bytes are found by walking the engine's own action list: after a rematerialised forward it holds the
    # micro-batch's boundary input; after any other forward or a recompute, its input, saved activations and
    # output; a full backward, or the weight half of a split one, frees its micro-batch. Under offload a stored
    # input waits in host memory (past the first chunk), and saved activations too but for WINDOW layers' worth.
    actions = sched.build(schedule, stage, stages, microbatches, checkpoint, virtual)
    chunks = sorted({a.chunk for a in actions})
    moved = offload != "none"
    restoring = sched.restores(actions)
    restores = [(a.microbatch, a.chunk) for a in restoring]
    after = dict(zip(restores, restores[1:]))  # what each restore brings back next (pipeline/executor.py)
    first = {id(a) for a in restoring}
    # Counted as they change: a walk of M micro-batches would otherwise recount O(M) keys at each of its points.
    blocks = 2 if larger else 1
    counts = [0] * (len(chunks) * blocks * len(KEPT))
    start = {c: i * blocks * len(KEPT) for i, c in enumerate(chunks)}

    def block(key: tuple[int, int]) -> int:
        return start[key[1]] + len(KEPT) * (0 < larger <= key[0])

    held = tuple(_Tally(counts, block, k) for k in range(len(KEPT)))
    whole, inputs, host, parked, fetched, active, redone, split, split_redone, waiting = held
    points: set[tuple[int, tuple[int, ...]]] = set()

    def bring(key: tuple[int, int] | None, moves: tuple[tuple[_Tally, _Tally], ...]) -> None:
        for away, back in moves:
            if key is not None and key in away:
                away.discard(key)
                back.add(key)

    # A message changes nothing: its point is the one before it (or none held, which any point covers).
    for action in (a for a in actions if a.kind in sched.COMPUTE):
        key, kind = (action.microbatch, action.chunk), action.kind
        restore = id(action) in first
        if restore:
            points.add((0, tuple(counts)))
            bring(key, ((host, inputs), (parked, active), (fetched, active)))  # what was not brought back ahead
        if kind is Kind.BWD_INPUT and moved:
            bring(key, ((active, split), (redone, split_redone)))
        elif kind is Kind.BWD_WEIGHT and moved:  # W brings back what B left in host memory
            bring(key, ((parked, split), (waiting, split_redone)))
        if moved and kind in sched.COMPUTE - {Kind.FWD, Kind.RECOMPUTE}:  # a backward holds its window
            points.add((1, tuple(counts)))
        if kind is Kind.FWD and action.remat:
            (host if offloaded(offload, action.chunk) else inputs).add(key)
        elif kind is Kind.FWD and moved:  # its layers go out as the forward moves on
            active.add(key)
            points.add((1, tuple(counts)))
            active.discard(key)
            parked.add(key)
        elif kind is Kind.FWD:
            whole.add(key)
        elif kind is Kind.RECOMPUTE:
            inputs.discard(key)
            (redone if moved else whole).add(key)
        elif kind is Kind.BWD_INPUT and moved:  # B leaves in host memory all that went there, not a last layer kept
            bring(key, ((split, parked), (split_redone, waiting)))
        elif kind in sched.RELEASE:  # a split backward keeps the graph until its W
            for kept in (whole, active, redone, split, split_redone):
                kept.discard(key)
        if restore:  # the next one's input is still in host memory as this action runs
            points.add((1, tuple(counts)))
            bring(after.get(key), ((host, inputs), (parked, fetched)))
        points.add((1, tuple(counts)))
    return points


def _maximal(vectors: Iterable[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors no other one covers in every entry: with bytes never negative, the only ones that can be most."""
    unique = sorted(set(vectors), key=sum, reverse=True)
    kept: list[tuple[int, ...]] = []
    for v in unique:
        if not any(all(map(operator.ge, k, v)) for k in kept):
            kept.append(v)
    return tuple(kept)


Counts = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per count vector, where it is not zero and what


@functools.lru_cache(maxsize=1 << 16)
def _readings(schedule: str, stage: int, stages: int, microbatches: int, checkpoint: str, virtual: int,
              offload: str, larger: int = 0) -> tuple[Counts, ...]:
    """The walk's counts that can set the stored, peak (device `KEPT` counts) and host readings, per chunk."""
    # A search prices thousands of cuts of one schedule: each reading is taken over these few maximal counts. Each
    # stage is walked once: an 8-device search walks more than 4,096 (4,385 for the ImageNet AmoebaNet-B recipe).
    points = _walk(schedule, stage, stages, microbatches, checkpoint, virtual, offload, larger)
    width = len(next(iter(points))[1])
    device, in_host = (operator.itemgetter(*(i for i in range(width) if i % len(KEPT) in positions))
                       for positions in (_ON_DEVICE, _IN_HOST))
    readings = (_maximal(device(c) for kind, c in points if kind == 0), _maximal(device(c) for _, c in points),
                _maximal(in_host(c) for _, c in points))
    # Each as the places it counts anything at and those counts: a count of zero adds nothing to the bytes.
    return tuple(tuple((tuple(i for i, n in enumerate(c) if n), tuple(n for n in c if n)) for c in counts)
                 for counts in readings)


def _saved(figures: ModelFigures, start: int, stop: int, size: int, first: bool = True) -> float:
    # The stage's first layer saves the stage's input, which the walk already holds as the boundary.
    fixed, per_example, _ = figures.sums
    total = fixed[stop] - fixed[start] + (per_example[stop] - per_example[start]) * size
    return total - (figures.layers[start].saved_input.at(size) if first and stop > start else 0.0)


def _window(figures: ModelFigures, start: int, stop: int, size: int, width: int) -> float:
    """The most that `width` neighbouring layers of [start, stop) save."""
    sums = figures.window_sums.get((size, width))
    if sums is None:
        sums = figures.window_sums[size, width] = [_saved(figures, i, i + width, size, first=False)
                                                   for i in range(len(figures.layers) - width + 1)]
    # Only the window at the stage's first layer leaves out the stage's input.
    first = _saved(figures, start, min(start + width, stop), size)
    return max(first, max(sums[start + 1:stop - width + 1], default=first))


def _kept(figures: ModelFigures, start: int, stop: int, size: int, moved: bool) -> tuple[tuple[float, ...], ...]:
    """Bytes of a micro-batch kept each way on chunk [start, stop): on the device (`_ON_DEVICE`'s order), in host."""
    # A search prices each chunk many times over, in stages and configurations that differ elsewhere.
    key = (start, stop, size, moved)
    if key not in figures.kept:
        # The last stage's output is its loss, a scalar. The window only counts under offload.
        boundary = figures.layers[start - 1].output.at(size) if start else 0.0
        output = figures.layers[stop - 1].output.at(size) if stop != len(figures.layers) else 0.0
        saved = _saved(figures, start, stop, size)
        window, wide = (_window(figures, start, stop, size, w) for w in (WINDOW, WINDOW + 1)) if moved else (0, 0)
        last = _saved(figures, stop - 1, stop, size, first=stop - 1 == start) if moved else 0.0
        # A split backward of a recompute holds its last layer and a wider window: at the top, or below it.
        top = max(start, stop - WINDOW - 1)
        below = _window(figures, start, stop - 1, size, WINDOW + 1) if moved and stop - 1 > start else 0.0
        wide_last = max(_saved(figures, top, stop, size, first=top == start), last + below) if moved else 0.0
        kept = boundary + output
        # A backward keeps its host copies.
        figures.kept[key] = ((kept + saved, boundary, kept, kept + last, kept + window, kept + window, kept + wide,
                              kept + wide_last, kept + last),
                             (boundary, saved, saved, saved, saved - last, saved, saved - last, saved - last))
    return figures.kept[key]


def _most(counts: Counts, bytes_each: Sequence[float]) -> float:
    """The most bytes any of the count vectors holds."""
    return max((sum(map(operator.mul, n, map(bytes_each.__getitem__, at)), 0.0) for at, n in counts), default=0.0)


@functools.lru_cache(maxsize=256)
def _microbatch_sizes(batch_size: int, microbatches: int) -> tuple[tuple[int, ...], int]:
    """The sizes the walk counts apart, largest first, and how many micro-batches have the largest if not all."""
    split = microbatch.sizes(batch_size, microbatches)
    larger = split.count(split[0]) if split[0] != split[-1] else 0
    return tuple(sorted(set(split), reverse=True)), larger


def _stage(figures: ModelFigures, chunks: Sequence[range], stage: int, stages: int, batch_size: int,
           microbatches: int, schedule: str, checkpoint: str,
           offload: str) -> tuple[int, list[tuple[tuple[float, ...], ...]], float, tuple[Counts, ...]]:
    """The stage's parameters, `_kept` per chunk and micro-batch size, the model input it holds, its counts."""
    sizes, larger = _microbatch_sizes(batch_size, microbatches)
    # The model's input reaches the device as the whole mini-batch, split there into views (as the engine feeds
    # it): the stage of the first chunk holds all of it through the step, whatever number of micro-batches
    # it keeps, so the first chunk's inputs count once, whole, rather than per micro-batch held.
    batch_input = figures.input.at(batch_size) if any(r.start == 0 for r in chunks) else 0.0
    kept = [_kept(figures, r.start, r.stop, size, offload != "none") for r in chunks for size in sizes]
    return (figures.params(chunks), kept, batch_input,
            _readings(schedule, stage, stages, microbatches, checkpoint, len(chunks), offload, larger))


def stage_footprint(figures: ModelFigures, chunks: Sequence[range], stage: int, stages: int, batch_size: int,
                    microbatches: int, schedule: str, checkpoint: str, bytes_per_param: float,
                    offload: str = "none") -> Footprint:
    """The predicted memory of the stage holding the layer ranges `chunks` (V of them, in chunk order)."""
    params, kept, batch_input, (stored, peak, host) = _stage(figures, chunks, stage, stages, batch_size,
                                                             microbatches, schedule, checkpoint, offload)
    on_device = [b for device, _ in kept for b in device]
    in_host = [b for _, held in kept for b in held]
    holds_loss = any(r.stop == len(figures.layers) for r in chunks)
    loss = figures.layers[-1].output.at(_microbatch_sizes(batch_size, microbatches)[0][0]) if holds_loss else 0.0
    return Footprint(params, params * bytes_per_param, _most(stored, on_device) + batch_input,
                     _most(peak, on_device) + batch_input, sum(len(r) for r in chunks), _most(host, in_host),
                     tuple(len(r) for r in chunks), loss)


def stage_total(figures: ModelFigures, chunks: Sequence[range], stage: int, stages: int, batch_size: int,
                microbatches: int, schedule: str, checkpoint: str, bytes_per_param: float,
                offload: str = "none") -> float:
    """`stage_footprint(...).total_bytes`, its peak alone priced: what a memory search asks millions of times."""
    params, kept, batch_input, (_, peak, _) = _stage(figures, chunks, stage, stages, batch_size, microbatches,
                                                     schedule, checkpoint, offload)
    return params * bytes_per_param + (_most(peak, [b for device, _ in kept for b in device]) + batch_input)


def weights_floor(figures: ModelFigures, bytes_per_param: float) -> Callable[[int, int], float]:
    """A stage's bytes at least, by its layers [start, stop): its weights, never fewer for a longer stage."""
    if figures.ties:
        return lambda start, stop: figures.params([range(start, stop)]) * bytes_per_param
    params = figures.sums[2]  # a cut search asks this for every pair of layers: two lookups, not a call
    return lambda start, stop: (params[stop] - params[start]) * bytes_per_param


def memory_floor(figures: ModelFigures, stages: int, batch_size: int, microbatches: int, schedule: str,
                 checkpoint: str, bytes_per_param: float, offload: str = "none") -> Callable[[int, int], float]:
    """A stage's bytes at least, by its layers [start, stop) in any place: never fewer for a longer stage."""
    weights = weights_floor(figures, bytes_per_param)
    size = _microbatch_sizes(batch_size, microbatches)[0][-1]  # the smallest: a floor
    # Each stage's peak holds at least `whole` micro-batches' saved activations (a backward needs them), all its
    # layers' but the first's, whose input is the stage's boundary; with no byte count below zero, a lower bound
    # near the peak, so that a cut search prices only the stages that may beat the best it has.
    whole = min(max((dict(zip(at, n)).get(0, 0) for at, n in
                     _readings(schedule, s, stages, microbatches, checkpoint, 1, offload)[1]), default=0)
                for s in range(stages))
    if not whole or any(min(f.output.at(size), f.saved_input.at(size), f.saved.at(size) - f.saved_input.at(size)) < 0
                        for f in figures.layers):
        return weights
    fixed, per_example, _ = figures.sums
    return lambda start, stop: weights(start, stop) + whole * (
        fixed[stop] - fixed[start + 1] + (per_example[stop] - per_example[start + 1]) * size)


def stage_chunks(balance: Sequence[int], schedule: str, virtual: int) -> list[list[range]]:
    """Each stage's layer ranges under `balance` (K x V chunks, placed as the schedule says), in chunk order."""
    ranges = partition.stage_ranges(balance)
    stages = len(balance) // virtual
    placed = schedules.get(schedule).placement
    return [[ranges[c] for c in placement.chunks_of(s, stages, virtual, placed)] for s in range(stages)]


def footprints(figures: ModelFigures, balance: Sequence[int], batch_size: int, microbatches: int, schedule: str,
               checkpoint: str, bytes_per_param: float, virtual: int = 1, offload: str = "none") -> list[Footprint]:
    """Every stage's predicted memory under `balance` (K x V chunks, placed as the schedule says)."""
    per_stage = stage_chunks(balance, schedule, virtual)
    return [stage_footprint(figures, chunks, s, len(per_stage), batch_size, microbatches, schedule, checkpoint,
                            bytes_per_param, offload) for s, chunks in enumerate(per_stage)]


def stage_needs(figures: ModelFigures, balance: Sequence[int], batch_size: int, microbatches: int, schedule: str,
                checkpoint: str, bytes_per_param: float, virtual: int,
                known: dict[tuple[int, tuple[int, ...]], float], offload: str = "none") -> list[float]:
    """Every stage's bytes under `balance`, as `footprints`, remembered in `known` by the stage's chunks."""
    # A search that moves one cut so prices only the stages it changed.
    bounds = list(itertools.accumulate(balance, initial=0))
    picks = _bounds_of(len(balance) // virtual, virtual, schedules.get(schedule).placement)
    out = []
    for s, pick in enumerate(picks):
        key = (s, pick(bounds))
        if key not in known:
            chunks = [range(start, stop) for start, stop in zip(key[1][::2], key[1][1::2])]
            known[key] = stage_total(figures, chunks, s, len(picks), batch_size, microbatches, schedule, checkpoint,
                                     bytes_per_param, offload)
        out.append(known[key])
    return out


@functools.lru_cache(maxsize=256)
def _bounds_of(stages: int, virtual: int, placed: str) -> tuple[Callable[[list[int]], tuple[int, ...]], ...]:
    """Per stage, what takes its chunks' starts and stops, in chunk order, out of a balance's running sums."""
    # A search asks every stage's chunks of millions of cuts: picked at once, as its key in `stage_needs`.
    return tuple(operator.itemgetter(*(b for c in placement.chunks_of(s, stages, virtual, placed) for b in (c, c + 1)))
                 for s in range(stages))


@dataclass
class CutMemory:
    """Predicted bytes of the stages of a K-stage pipeline by where it is cut, and the cuts that fit a rank."""

    figures: ModelFigures
    stages: int
    batch_size: int   # the mini-batch of one replica
    microbatches: int
    schedule: str
    checkpoint: str
    bytes_per_param: float
    capacity: float = math.inf  # what one rank may use
    capacity_note: str = ""     # e.g. "22.1 GiB of available RAM shared by 4 ranks"
    offload: str = "none"       # pipeline.offload
    shared: bool = False        # the ranks share one pool (CPU RAM): more of them each get less
    _known: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)
    _chunked: dict[tuple[int, tuple[int, ...]], float] = field(default_factory=dict, repr=False)

    def need(self, stage: int, start: int, stop: int) -> float:
        """Bytes the stage holding layers [start, stop) needs at its peak (V=1)."""
        key = (stage, start, stop)  # the stage's place counts: earlier stages hold more micro-batches in flight
        if key not in self._known:
            self._known[key] = stage_total(self.figures, [range(start, stop)], stage, self.stages, self.batch_size,
                                           self.microbatches, self.schedule, self.checkpoint, self.bytes_per_param,
                                           self.offload)
        return self._known[key]

    @functools.cached_property
    def floor(self) -> Callable[[int, int], float]:
        """Bytes any stage of layers [start, stop) needs at least, never fewer for a longer one (`memory_floor`)."""
        return memory_floor(self.figures, self.stages, self.batch_size, self.microbatches, self.schedule,
                            self.checkpoint, self.bytes_per_param, self.offload)

    def fits(self, stage: int, start: int, stop: int) -> bool:
        """Whether the stage fits its rank's memory."""
        return self.need(stage, start, stop) <= self.capacity

    def needs(self, balance: Sequence[int]) -> list[float]:
        """Every stage's bytes under `balance` (K x V chunks, placed as the schedule says)."""
        return stage_needs(self.figures, balance, self.batch_size, self.microbatches, self.schedule, self.checkpoint,
                           self.bytes_per_param, len(balance) // self.stages, self._chunked, self.offload)

    def within(self, costs: Sequence[float], virtual: int = 1) -> list[int] | None:
        """The min-max cut of `costs` into K x `virtual` chunks among those whose every stage fits, or None."""
        if virtual > 1:
            return partition.interleaved_within(costs, self.stages * virtual, self.needs, self.capacity)
        floor = self.floor
        return partition.balance_within(costs, self.stages, self.fits,
                                        lambda start, stop: floor(start, stop) <= self.capacity)

    def least(self, costs: Sequence[float] = (), virtual: int = 1,
              below: float = math.inf) -> tuple[float, list[int]] | None:
        """The least bytes the fullest stage can need and a cut needing them, if less than `below` (else None)."""
        # Exact for V=1 (a min-max cut of stage memory); interleaved: what `partition.least_memory` finds from the
        # min-max cut of `costs`.
        if virtual == 1:
            return partition.min_max_split(len(self.figures.layers), self.stages, self.need, self.floor, below)
        assert costs, "an interleaved search starts from the min-max cut of the layers' costs"
        balance = partition.least_memory(partition.balance_by_cost(costs, self.stages * virtual), self.needs)
        peak = max(self.needs(balance))
        return (peak, balance) if peak < below else None


def greedy_fit(figures: ModelFigures, stages: int, budget: float, batch_size: int, microbatches: int,
               schedule: str, checkpoint: str, bytes_per_param: float, offload: str = "none",
               need: Callable[[Footprint], float] | None = None) -> list[Footprint] | None:
    """At most `stages` stages, each as long as it fits `budget` by `need` (default: its total); None if none fits."""
    # Filling each stage as far as it fits uses the fewest stages a contiguous cut can, as a stage never needs less
    # when it gains a layer; so its end is found by doubling its length, then halving the step (deep models).
    n = len(figures.layers)
    out: list[Footprint] = []
    start = 0
    for stage in range(stages):
        if start == n:
            break

        def trial(stop: int, stage: int = stage, start: int = start) -> Footprint | None:
            found = stage_footprint(figures, [range(start, stop)], stage, stages, batch_size, microbatches, schedule,
                                    checkpoint, bytes_per_param, offload)
            return found if (need(found) if need else found.total_bytes) <= budget else None

        best = trial(start + 1)
        if best is None:
            return None
        good, bad, step = start + 1, n + 1, 1   # stops: `good` fits, `bad` does not (n + 1: past the end)
        while good < n:  # double the stage until it no longer fits or holds every layer left
            stop = min(good + step, n)
            found = trial(stop)
            if found is None:
                bad = stop
                break
            best, good, step = found, stop, step * 2
        while bad - good > 1:  # then halve the gap
            mid = (good + bad) // 2
            found = trial(mid)
            if found is None:
                bad = mid
            else:
                best, good = found, mid
        out.append(best)
        start = good
    return out if start == n else None


# Layers up to which a V's cut is searched one layer move at a time: far deeper, the moves from the balanced
# cut run into partition.TRIALS (10,002 layers took half a minute per member on a 2-core CPU).
V_SEARCHED = 512


def v_fit(figures: ModelFigures, stages: int, budget: float, batch_size: int, microbatches: int, schedule: str,
          checkpoint: str, bytes_per_param: float, offload: str = "none",
          need: Callable[[Footprint], float] | None = None, virtual: int = 2) -> list[Footprint] | None:
    """K x `virtual` chunks (a V's 2, or interleaved) whose fullest stage fits `budget` (by `need` where given) with
    the least; or None."""
    # The least a local search finds from the cut balanced by per-layer bytes (that cut alone past `V_SEARCHED`
    # layers); None too with fewer layers than chunks.
    n, chunks = len(figures.layers), virtual * stages
    if n < chunks:
        return None
    size = max(microbatch.sizes(batch_size, microbatches))
    costs = [layer.saved.at(size) + layer.params * bytes_per_param for layer in figures.layers]
    needs = CutMemory(figures, stages, batch_size, microbatches, schedule, checkpoint, bytes_per_param,
                      offload=offload).needs
    balance = partition.balance_by_cost(costs, chunks)
    if n <= V_SEARCHED:
        balance = partition.least_memory(balance, needs, budget)
    if max(needs(balance)) > budget:
        return None
    found = footprints(figures, balance, batch_size, microbatches, schedule, checkpoint, bytes_per_param, virtual,
                       offload)
    return found if need is None or max(need(fp) for fp in found) <= budget else None


def available_bytes(device: torch.device | str) -> int:
    """Memory free for a job: a GPU's free memory, or the RAM the kernel could give without swapping."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    found = meminfo_available()
    return found if found is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Capacity:
    """What each rank of a job may use on the machine it runs on, and why."""

    per_rank_bytes: float
    shared: bool        # True: the ranks share one pool (CPU RAM); False: a device each
    description: str    # e.g. "22.1 GiB of available RAM shared by 4 ranks"


def capacity(ranks_on_node: int, device: str | None = None, available: float | None = None) -> Capacity:
    """Each rank's memory: a GPU's free memory each on CUDA, else an equal share of the available RAM."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    free = available if available is not None else float(available_bytes(kind))
    if kind == "cuda":
        return Capacity(free, False, f"{human_bytes(free)} free on each GPU")
    ranks = max(ranks_on_node, 1)
    share = f"shared by {ranks} ranks" if ranks > 1 else "for 1 rank"
    return Capacity(free / ranks, True, f"{human_bytes(free)} of available RAM {share}")
