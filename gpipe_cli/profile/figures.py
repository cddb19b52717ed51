"""Measured per-layer memory figures, per example and per micro-batch, for models too large to run.

One forward of a real model with one `ActivationMeter` across all its layers gives, for every layer,
the bytes autograd newly saves in it (so a tensor shared by neighbours counts once) and the bytes of
its output. Activation bytes are affine in the batch (per-example tensors plus a few fixed ones such
as masks and per-channel statistics), so two batch sizes give both parts exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_cli.bench.subject import example_batch
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter
from gpipe_cli.pipeline.stage import as_tensors, from_tensors

PROBE_BATCHES = (2, 4)  # two examples at least: BatchNorm refuses a single value per channel


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


@dataclass(frozen=True)
class LayerFigures:
    """One layer: its parameters, the activations it saves, and the output it hands on."""

    name: str
    params: int
    saved: Affine
    output: Affine


@dataclass(frozen=True)
class ModelFigures:
    """Every layer's figures plus the model input (the first stage's boundary)."""

    input: Affine
    layers: tuple[LayerFigures, ...]


def _nbytes(value: Any) -> int:
    tensors, _ = as_tensors(value)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _leaves(value: Any) -> Any:
    tensors, bare = as_tensors(value)
    return from_tensors([None if t is None else t.detach().requires_grad_(t.is_floating_point())
                         for t in tensors], bare)


def probe(spec: ModelSpec, examples: int, seed: int) -> tuple[int, list[tuple[int, int]]]:
    """Input bytes, and per layer (bytes newly saved, output bytes), for one forward of `examples` (loss included)."""
    inputs, targets = example_batch(spec, examples, seed)
    meter = ActivationMeter()
    x = _leaves(inputs)
    handles = [meter.hold(t) for t in as_tensors(x)[0] if t is not None]
    rows = []
    factories = spec.factories()
    # Layers stay alive to the end: a freed parameter's address could be reused by an activation,
    # which the meter would then take for the (excluded) parameter.
    kept = []
    with meter.saved_tensors():
        for index in range(len(factories)):
            (layer,) = build_layers(factories, [index], seed)
            layer.train()
            kept.append(layer)
            meter.exclude([*layer.parameters(), *layer.buffers()])
            before = meter.current
            x = layer(x)
            if index == len(factories) - 1:
                x = spec.loss(x, targets)  # the loss's saved tensors belong to the last stage
            rows.append((meter.current - before, _nbytes(x)))
    del handles, x, kept
    return _nbytes(inputs), rows


def measure(spec: ModelSpec, seed: int = 0, batches: Sequence[int] = PROBE_BATCHES) -> ModelFigures:
    """Per-layer figures of `spec`, fitted from forwards at two batch sizes."""
    (b0, b1) = batches
    in0, rows0 = probe(spec, b0, seed)
    in1, rows1 = probe(spec, b1, seed)
    params = layer_param_counts(spec)
    layers = tuple(LayerFigures(name, params[i], Affine.through(b0, r0[0], b1, r1[0]),
                                Affine.through(b0, r0[1], b1, r1[1]))
                   for i, (name, r0, r1) in enumerate(zip(spec.layer_names, rows0, rows1)))
    return ModelFigures(Affine.through(b0, in0, b1, in1), layers)


def layer_param_counts(spec: ModelSpec) -> list[int]:
    """Parameters of every layer, built on the meta device (no memory needed)."""
    counts = []
    with torch.device("meta"):
        for layer in spec.layers:
            counts.append(sum(p.numel() for p in layer.build().parameters()))
    return counts


def role(name: str) -> str:
    """The kind of layer a name denotes, equal for layers that are built alike whatever the depth.

    The first two normal cells of a stack (`cell_2_1`, `cell_2_2`) differ from the later ones; all
    Transformer layers are alike, so `layer_7` is `layer`.
    """
    cell = re.fullmatch(r"cell_(\d+)_(\d+)", name)
    if cell:
        # The first two cells of a stack see a reduced or projected previous state; the rest do not.
        position = {"1": "first", "2": "second"}.get(cell.group(2), "rest")
        return f"cell_{cell.group(1)}_{position}"
    numbered = re.fullmatch(r"(layer|encoder|decoder)_\d+", name)
    return numbered.group(1) if numbered else name
