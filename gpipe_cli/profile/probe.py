"""The device's own overhead: a few short probe steps fit what the saved-tensor accounting cannot see."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate import kept
from gpipe_cli.estimate.subject import example_batch
from gpipe_cli.memory_model import Footprint, ModelFigures
from gpipe_cli.models import families
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.profile import account
from gpipe_cli.units import human_bytes


@dataclass(frozen=True)
class Probe:
    """One short training step of a small member at K=1, and what the memory model predicts for it."""

    spec: ModelSpec
    figures: ModelFigures
    batch_size: int
    microbatches: int
    schedule: str
    checkpoint: str
    optimizer: str
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # the member's build parameters, to price its step

    def predicted(self) -> Footprint:
        """The memory model's single stage for this step."""
        per_param = kept.bytes_per_parameter(self.optimizer)
        return mm.footprints(self.figures, [len(self.figures.layers)], self.batch_size, self.microbatches,
                             self.schedule, self.checkpoint, per_param)[0]

    def run(self, device: torch.device) -> list[account.StageMemory]:
        """Train the step on `device` (the engine's executor, then one optimizer step)."""
        inputs, targets = example_batch(self.spec, self.batch_size, self.seed)
        return account.measure(self.spec, inputs, targets, [len(self.spec.layers)], self.microbatches,
                               self.schedule, self.checkpoint, self.optimizer, self.seed, device)


class AccountingMeter:
    """The CPU: the engine's exact saved-tensor accounting, stage totals as `account.measure` reads them."""

    name = "saved-tensor accounting (CPU)"

    def peak(self, probe: Probe) -> float:
        """The stage's accounted total."""
        return float(probe.run(torch.device("cpu"))[0].total_bytes)


class CudaMeter:
    """A CUDA GPU: the allocator's reserved peak over the step."""

    name = "CUDA allocator reserved peak"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peak(self, probe: Probe) -> float:
        """The reserved peak over the step above what it held before: allocations with rounding, cache, workspaces."""
        gc.collect()
        torch.empty(1, device=self.device)  # the allocator's state must exist before its peak is reset
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        probe.run(self.device)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        return float(peak - base)


# Reads the bytes a device peaked at over one probe step: weights, gradients, optimizer state, activations, overhead.
Meter = AccountingMeter | CudaMeter


def remat_key(checkpoint: str) -> str:
    """The activations factor a checkpoint mode uses: rematerialised steps keep and rebuild different tensors."""
    return "never" if checkpoint == "never" else "remat"


@dataclass(frozen=True)
class Correction:
    """What a device needs beyond the accounting: `workspace + weights + activations x A[remat] + loss x L[remat]`."""

    workspace: float = 0.0
    activations: dict[str, float] = field(default_factory=dict)
    loss: dict[str, float] = field(default_factory=dict)  # per remat key; none where the loss's output is small
    meter: str = ""
    points: tuple[tuple[float, float, float], ...] = ()  # per probe: (predicted, measured, corrected) bytes
    unseen: tuple[str, ...] = ()  # activations factors kept at 1: their probes' peaks did not follow the activations

    def bytes(self, footprint: Footprint, checkpoint: str) -> float:
        """The device's bytes for a stage the memory model predicts as `footprint`."""
        key = remat_key(checkpoint)
        # The weights, gradients and optimizer state are counted exactly: fitting a factor on them only let the
        # probes' noise in (AmoebaNet-D's, of a few MB, read x1.6 on an H100).
        return (self.workspace + footprint.weights_bytes + self.activations.get(key, 1.0) * footprint.peak_bytes
                + self.loss.get(key, 0.0) * footprint.loss_bytes)

    def worst_error(self) -> float:
        """The largest relative gap between a probe's corrected prediction and its measured peak."""
        return max((abs(c - m) / m for _, m, c in self.points if m > 0), default=0.0)

    def describe(self) -> str:
        """One line: what was added and scaled, and how well it matched the probes."""
        acts = ", ".join(f"{key} x{value:.3f}" for key, value in sorted(self.activations.items()))
        loss = ", ".join(f"{key} x{value:.3f}" for key, value in sorted(self.loss.items()))
        unseen = (f"; activations {', '.join(self.unseen)} kept x1.000, unsure: the probes peaked alike whatever "
                  f"their activations (in the optimizer's update)" if self.unseen else "")
        return (f"device correction ({self.meter}, {len(self.points)} probe steps): + {human_bytes(self.workspace)} "
                f"workspace, activations {acts or 'x1.000'}{f', loss gradients {loss}' if loss else ''}; probes "
                f"matched within {100 * self.worst_error():.1f}%{unseen}")

    def to_json(self) -> dict[str, Any]:
        """As plain data."""
        return {"workspace_bytes": self.workspace, "activations_factor": dict(self.activations),
                "loss_factor": dict(self.loss), "meter": self.meter,
                "probes": [{"predicted_bytes": p, "measured_bytes": m, "corrected_bytes": c}
                           for p, m, c in self.points],
                "worst_error": self.worst_error(), "unseen": list(self.unseen)}


NONE = Correction(meter="none")


def from_json(data: dict[str, Any] | None) -> Correction:
    """A correction as `Correction.to_json` wrote it (None: none)."""
    if not data:
        return NONE
    return Correction(data["workspace_bytes"], dict(data["activations_factor"]), dict(data.get("loss_factor", {})),
                      data.get("meter", ""), unseen=tuple(data.get("unseen", ())))


# A loss term is fitted only where the loss's output is at least this share of the probes' activations: below,
# its column is the allocator's noise (AmoebaNet-D's 1,000 classes against its cells' feature maps).
LOSS_SHARE = 0.05


def fit(points: Sequence[tuple[Footprint, str, float]], meter: str = "") -> Correction:
    """The correction that best maps each (predicted footprint, checkpoint, measured peak) onto its peak."""
    keys = sorted({remat_key(c) for _, c, _ in points})
    # A factor the probes cannot tell (nothing of that kind varied, or their peaks did not follow it) stays 1. On
    # an H100 the paper's Transformer probed at one and two examples peaked alike, in the optimizer's update: its
    # activations fitted x0.47, and its 3-layer model then peaked at 35 GB against 16 GB predicted.
    unseen = tuple(k for k in keys if _unseen(points, k))
    told = [k for k in keys if k not in unseen]
    used = [(fp, remat_key(c), measured - fp.weights_bytes) for fp, c, measured in points if remat_key(c) in told]
    losses = [k for k in told if max(fp.loss_bytes for fp, c, _ in used if c == k)
              >= LOSS_SHARE * max(fp.peak_bytes for fp, c, _ in used if c == k)]

    def solve(with_workspace: bool) -> list[float]:  # least squares, in float64
        rows = [([1.0] if with_workspace else []) + [fp.peak_bytes if c == k else 0.0 for k in told]
                + [fp.loss_bytes if c == k else 0.0 for k in losses] for fp, c, _ in used]
        a = torch.tensor(rows, dtype=torch.float64)
        b = torch.tensor([value for _, _, value in used], dtype=torch.float64).unsqueeze(1)
        scale = a.abs().amax(dim=0).clamp(min=1.0)  # columns of bytes and of ones: keep the system well scaled
        return [float(v) for v in torch.linalg.lstsq(a / scale, b).solution.squeeze(1) / scale]

    workspace, factors, found = 0.0, dict[str, float](), dict[str, float]()
    while used:
        solution = solve(True)
        workspace = solution.pop(0)
        if workspace < 0:  # the rounding read as a larger factor: refitted as none
            workspace, solution = 0.0, solve(False)
        factors = {k: f if f > 0.1 else 1.0 for k, f in zip(told, solution)}
        found = dict(zip(losses, solution[len(told):]))
        if all(v >= 0.1 for v in found.values()):
            break
        losses = [k for k in losses if found[k] >= 0.1]  # a loss term near or below 0 is the others' noise: dropped
    correction = Correction(workspace, factors | {k: 1.0 for k in unseen}, found, meter, unseen=unseen)
    return replace(correction, points=tuple((fp.total_bytes, m, correction.bytes(fp, c)) for fp, c, m in points))


def _unseen(points: Sequence[tuple[Footprint, str, float]], key: str) -> bool:
    """Whether the probes of remat `key` that differ only in activations read peaks apart by under half as much."""
    moves = [(abs(m1 - m0), abs(b.peak_bytes - a.peak_bytes))
             for (a, c0, m0), (b, c1, m1) in itertools.combinations(points, 2)
             if remat_key(c0) == remat_key(c1) == key and a.weights_bytes == b.weights_bytes
             and a.peak_bytes != b.peak_bytes]
    return bool(moves) and all(measured < predicted / 2 for measured, predicted in moves)


def steps(members: Sequence[tuple[ModelSpec, ModelFigures, dict[str, Any]]],
          rows: Sequence[tuple[str, int, int, str]], kind: str, schedule: str, optimizer: str,
          seed: int = 0, room: float | None = None) -> list[Probe]:
    """The probe steps of family `kind`'s two small members (built, priced, build parameters) per (M, checkpoint);
    with `room` (a device's bytes for one probe), micro-batches grow until activations outweigh the weights."""
    (small, large), least = members, families.of(kind).least_examples
    out = []
    for m, checkpoint in dict.fromkeys((m, c) for _, _, m, c in rows):
        def at(member: tuple[ModelSpec, ModelFigures, dict[str, Any]], size: int, m: int = m,
               checkpoint: str = checkpoint) -> Probe:
            return Probe(member[0], member[1], size * m, m, schedule, checkpoint, optimizer, seed, member[2])

        # A device peaks in the step or in the optimizer's update (every gradient, the state, its temporaries):
        # where a probe's activations weigh less than its weights, the update's peak hides them.
        size = least
        while room is not None and _hidden(at(small, size)) and at(small, 4 * size).predicted().total_bytes <= room:
            size *= 2
        # The small member again at twice the micro-batch, so that weights and activations vary apart.
        out += [at(small, size), at(large, size), at(small, 2 * size)]
    return out


def _hidden(step: Probe) -> bool:
    """Whether the step's activations weigh less than its weights, gradients and optimizer state."""
    predicted = step.predicted()
    return predicted.peak_bytes < predicted.weights_bytes


def calibrate(probes: Sequence[Probe], meter: Meter) -> Correction:
    """Run each probe step under `meter` and fit the correction."""
    return fit([(probe.predicted(), probe.checkpoint, meter.peak(probe)) for probe in probes], meter.name)
