"""A training step's figures: its time and where each stage spent it (always adding up), its model TFLOP/s and MFU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpipe_cli.pipeline.stats import PARTS, StepStats
from gpipe_cli.records import Utilization
from gpipe_cli.units import flop_rate

_MEASURED = PARTS[:-1]  # every part but `other`, which is what is left of the step


@dataclass(frozen=True)
class StepFigures:
    """A step's time, and per stage of one replica the seconds of each part (`PARTS`), adding up to it."""

    seconds: float
    parts: dict[str, list[float]]

    @property
    def bubble(self) -> float:
        """The measured bubble: mean over stages of the time waiting for a peer / the step time."""
        waits = self.parts["wait"]
        return sum(waits) / len(waits) / self.seconds if waits and self.seconds > 0 else 0.0

    @property
    def idle(self) -> float:
        """Mean over stages of the share of the step not spent computing."""
        compute = self.parts["compute"]
        if not compute or self.seconds <= 0:
            return 0.0
        return sum(1.0 - c / self.seconds for c in compute) / len(compute)


def step_figures(stats: StepStats, wall: float) -> StepFigures:
    """The step time (the longer of rank 0's `wall` time and every stage's own) and each stage's parts of it."""
    # Every stage of every replica bounds the step (they all ran it), not only replica 0, whose parts are shown.
    seconds = max([wall, *(s.step_time for s in stats.stages)])
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    stages = stats.of_replica(0)
    # The holder of a tied weight that comes last to its gradient sum waits for nobody: its time there is the
    # transfer, which every holder spends; the rest of a holder's time there it waited for the others.
    transfer = min((s.shared for s in stages if s.shared > 0), default=0.0)
    for stage in stages:
        waited = max(stage.shared - transfer, 0.0)
        measured = [max(stage.busy, 0.0), max(stage.wait + waited, 0.0), max(stage.comm + stage.shared - waited, 0.0),
                    max(stage.optimizer, 0.0)]
        total = sum(measured)
        # Spans can overlap (a reduction on another GPU stream while the device computes): parts that
        # would exceed the step keep their proportions and fill it, so no stage reads more than the step.
        if total > seconds > 0:
            measured = [m * seconds / total for m in measured]
        for part, value in zip(_MEASURED, measured):
            parts[part].append(value)
        parts["other"].append(max(seconds - sum(measured), 0.0))
    return StepFigures(seconds, parts)


# Dense peak TFLOP/s per GPU (no structured sparsity), from the vendors' data sheets, by training precision.
# `fp32` is plain FP32, not TF32: PyTorch runs float32 matrix products without TF32 unless asked to.
# NVIDIA H100 data sheet (SXM5 / PCIe / NVL): BF16 and FP16 989 / 756 / 835, FP32 67 / 51 / 60;
# H200 data sheet: as H100 SXM; A100 data sheet (SXM and PCIe): BF16 and FP16 312, FP32 19.5;
# L40S: BF16 362, FP32 91.6; L4: BF16 121, FP32 30.3; A10: BF16 125, FP32 31.2;
# V100 SXM2: FP16 125, FP32 15.7 (no BF16); T4: FP16 65, FP32 8.1 (no BF16).
# Looked up by the first key found in torch.cuda.get_device_name, in this order (H100 PCIe before H100,
# L40S before L4, A100 before A10).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}


def table_peak(device_name: str, precision: str) -> float | None:
    """The data-sheet TFLOP/s of a GPU named `device_name` at `precision` (None: not in the table)."""
    return next((rates.get(precision) for key, rates in PEAK_TFLOPS.items() if key.lower() in device_name.lower()),
                None)


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s of one rank that MFU is measured against (None: unknown), and where it comes from or why not."""

    flops_per_s: float | None
    source: str


def find_peak(override: float | None, device: str, precision: str, device_name: Callable[[], str],
              measured: Callable[[], float]) -> Peak:
    """One rank's peak: `train.peak_tflops`, else the table for a GPU, else on a CPU its `measured` matrix rate."""
    if override is not None:
        return Peak(override * 1e12, f"train.peak_tflops {override:g} TFLOP/s per rank")
    if device == "cuda":
        name = device_name()
        tflops = table_peak(name, precision)
        if tflops is None:
            return Peak(None, f"no known {precision} peak for {name}: set train.peak_tflops to see MFU")
        return Peak(tflops * 1e12, f"{name}'s data-sheet {precision} peak, {tflops:g} TFLOP/s per rank")
    rate = measured()
    return Peak(rate, f"this CPU's measured matrix-product rate, {flop_rate(rate)} per rank (not a "
                      f"data-sheet peak)")


@dataclass(frozen=True)
class ModelFlops:
    """The model FLOPs of a training step, from its forward FLOPs per example (or per token, for text)."""

    forward_per_example: float
    units_per_example: int | None  # tokens of an example the forward FLOPs were counted for (text); None: images

    def of_step(self, examples: float, units: float | None) -> float:
        """Model FLOPs of a step of `examples` (and `units` tokens, for text): 3x the forward."""
        if self.units_per_example and units is not None:
            return 3.0 * self.forward_per_example / self.units_per_example * units
        return 3.0 * self.forward_per_example * examples


def utilization_of(flops: float, seconds: float, peak_per_rank: float | None, ranks: int) -> Utilization:
    """A step's `tflops` (achieved model TFLOP/s, all ranks) and `mfu` (of the peak of all ranks, when known)."""
    if seconds <= 0 or flops <= 0:
        return {}
    achieved = flops / seconds
    out: Utilization = {"tflops": achieved / 1e12}
    if peak_per_rank:
        out["mfu"] = achieved / (peak_per_rank * ranks)
    return out
