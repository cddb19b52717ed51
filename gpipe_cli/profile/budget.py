"""`--budget`: the largest model of a family that fits a per-device memory budget at each K (GPipe Table 1)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate import kept
from gpipe_cli.limits import MAX_LAYERS
from gpipe_cli.memory_model import Affine, Footprint, LayerFigures, ModelFigures, greedy_fit, v_fit
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import layer_params, tie_groups
from gpipe_cli.models.registry import build_model
from gpipe_cli.pipeline import placement, schedules
from gpipe_cli.profile.probe import NONE, Correction
from gpipe_cli.profile.scenarios import chunks_per_stage

# What the search varies: never given by the user.
SEARCHED = ("layers", "filters")

# GPipe (Huang et al., 2019), Table 1: the largest model per scenario, its parameters, total parameter
# memory (12 bytes per parameter: RMSProp) and peak activation memory, over all accelerators.
PAPER_TABLE1: dict[str, dict[str, Any]] = {
    "amoebanet": {"hardware": "NVIDIA GPUs, 8GB each", "rows": {
        "naive-1": ("(18, 208)", "82M", "1.05GB", "6.26GB"), "pipeline-1": ("(18, 416)", "318M", "3.8GB", "3.46GB"),
        "pipeline-2": ("(18, 544)", "542M", "6.45GB", "8.11GB"),
        "pipeline-4": ("(36, 544)", "1.05B", "12.53GB", "15.21GB"),
        "pipeline-8": ("(72, 512)", "1.8B", "24.62GB", "26.24GB")}},
    "transformer": {"hardware": "Cloud TPUv3, 16GB each", "rows": {
        "naive-1": ("3", "282.2M", "11.7G", "3.15G"), "pipeline-1": ("13", "785.8M", "8.8G", "6.4G"),
        "pipeline-8": ("103", "5.3B", "59.5G", "50.9G"), "pipeline-32": ("415", "21.0B", "235.1G", "199.9G"),
        "pipeline-128": ("1663", "83.9B", "937.9G", "796.1G")}},
}

class Found(NamedTuple):
    """A search's largest fitting member: label, parameters, stages, and the bound that stopped it ("": the budget)."""

    label: str
    params: int
    stages: list[Footprint]
    bound: str = ""


def _largest(fits: Callable[[int], list[Footprint] | None], lo: int, hi: int,
             found: list[Footprint] | None = None) -> tuple[int, list[Footprint] | None]:
    """The largest size in [lo, hi) that fits, and its stages, by bisection (`found`: what `lo` fits with)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (stages := fits(mid)) is not None:
            lo, found = mid, stages
        else:
            hi = mid
    return lo, found


def _by_role(model: ModelFigures) -> dict[str, LayerFigures]:
    """The last layer of each role (the steady state of a repeated layer)."""
    return {mm.role(layer.name): layer for layer in model.layers}


def _assemble(spec: ModelSpec, roles: dict[str, LayerFigures], inputs: Affine,
              params: Callable[[str], int]) -> ModelFigures:
    return ModelFigures(inputs, tuple(LayerFigures(name, params(mm.role(name)), r.saved, r.output, r.saved_input)
                                      for name in spec.layer_names for r in [roles[mm.role(name)]]),
                        tie_groups(spec))


def _measure(spec: Any, seed: int, batches: tuple[int, int] = mm.PROBE_BATCHES,
             shapes_only: bool = False) -> tuple[ModelFigures, bool]:
    """A small member's figures, and whether they were measured on this machine (else shapes on the meta device)."""
    if not shapes_only:
        # One forward of shapes at the larger size says what measuring would hold: weights, gradients and
        # activations, with room to spare.
        _, rows = mm.probe(spec, max(batches), seed, "meta")
        need = sum(params * mm.PARAM_BYTES + saved + output for params, saved, output, _ in rows)
        if 3 * need <= mm.available_bytes("cpu"):
            return mm.measure(spec, seed, batches), True
    return kept.figures(spec, batches), False


class TransformerL:
    """Transformer-L: L identical layers between an embedding and a softmax."""

    kind = "transformer"
    title = "Transformer-L"
    # Its fixed sizes in the paper's Table 1.
    PAPER = dict(arch="decoder-only", d_model=2048, ff=8192, heads=32, vocab_size=32000, max_len=1024)
    SMALLEST = {"layers": 1}  # the searched sizes of its smallest member
    # What probing and searching cost in fixed layer calls (`sizing.Machine.call_seconds`), measured on a 2-core
    # x86 CPU at budgets of 16 GB and 80 GB: the probe is arithmetic, priced from its FLOPs instead; pricing a
    # member is a few sums (eight rows in 0.1 s).
    PROBE_CALLS = 0.0
    ROW_CALLS = (25.0, 0.0)   # a row under a loop placement: fixed, and per device
    V_ROW_CALLS = 350.0       # a row under a V, per device (its cuts of hundreds of layers searched: K=8 0.8 s)
    PROBE_LAYERS, PROBE_BATCHES = 2, (1, 2)  # the member measured, and its batches

    def __init__(self, fixed: dict[str, Any], seed: int = 0, max_layers: int = MAX_LAYERS,
                 shapes_only: bool = False) -> None:
        self.fixed, self.max_layers = fixed, max_layers
        # No BatchNorm here, so a single example is a valid probe (it halves the cost at paper sizes).
        self.probe, self.measured = _measure(build_model("transformer", layers=self.PROBE_LAYERS, **fixed), seed,
                                             self.PROBE_BATCHES, shapes_only)
        # Every layer is built alike, so one measured layer, repeated L times, prices any L exactly.
        self.roles = _by_role(self.probe)

    def figures(self, layers: int) -> ModelFigures:
        """The figures of the member with `layers` layers."""
        return _assemble(build_model("transformer", layers=layers, **self.fixed), self.roles, self.probe.input,
                         lambda role: self.roles[role].params)

    def members(self) -> list[tuple[ModelSpec, ModelFigures, dict[str, Any]]]:
        """The device probe's two small members (one and two layers): built, priced, and their build parameters."""
        return [(build_model("transformer", **p), self.figures(n), p)
                for n in (1, 2) for p in [{"layers": n, **self.fixed}]]

    def member(self, label: str) -> dict[str, Any]:
        """The build parameters of the member a row names, e.g. "13"."""
        return {"layers": int(label), **self.fixed}

    def figures_of(self, label: str) -> ModelFigures:
        """The figures of the member a row names."""
        return self.figures(int(label))

    def search(self, fits: Callable[[ModelFigures], list[Footprint] | None], least: int = 1) -> Found | None:
        """The deepest member that fits, up to `max_layers`, from the first with `least` pipeline layers or more."""
        best = None
        lo, hi = 0, min(max(1, least - 2), self.max_layers)  # the embedding and the softmax are layers too
        while (found := fits(self.figures(hi))) is not None:  # grow until it no longer fits
            best, lo = found, hi
            if hi == self.max_layers:  # a deeper member would fit too: the bound stops the search
                return Found(str(hi), sum(s.params for s in found), found,
                             f"{self.max_layers} layers, the most a recipe may have")
            hi = min(hi * 2, self.max_layers)
        layers, stages = _largest(lambda n: fits(self.figures(n)), lo, hi, best)
        return None if stages is None else Found(str(layers), sum(s.params for s in stages), stages)


class AmoebaNetD:
    """AmoebaNet-D (L, D): L normal cells in three stacks, D filters."""

    kind = "amoebanet"
    title = "AmoebaNet-D (L, D)"
    PAPER = dict(variant="d", image_size=224, num_classes=1000)  # its fixed sizes in the paper's Table 1
    # Probing (shape passes and accounted forwards of two small members) and searching are bound by Python, so
    # their cost is counted in fixed layer calls (`sizing.Machine.call_seconds`), measured on a 2-core x86 CPU
    # at budgets of 1 GB to 80 GB: the probe 11,000 (3.5 s there), a row 1,000 + 150 per device (K=8: 0.7 s),
    # a V's row 3,500 per device (its cuts are searched for members up to 240 cells deep, K=8: 6 to 10 s).
    PROBE_CALLS = 11_000.0
    ROW_CALLS = (1_000.0, 150.0)
    V_ROW_CALLS = 3_500.0
    PROBE_LAYERS = 9        # three normal cells per stack: the first two of a stack differ from the rest
    PROBE_WIDTHS = (16, 32, 48)
    WIDTH_STEP = 16
    SMALLEST = {"layers": 6, "filters": WIDTH_STEP}

    def __init__(self, fixed: dict[str, Any], seed: int = 0, max_layers: int = 240, max_width: int = 4096) -> None:
        self.fixed, self.max_layers, self.max_width = fixed, max_layers, max_width
        probes = [_measure(self._spec(self.PROBE_LAYERS, d), seed) for d in self.PROBE_WIDTHS[:2]]
        self.at = [_by_role(figures) for figures, _ in probes]
        self.input = probes[0][0].input
        self.measured = all(measured for _, measured in probes)
        specs = [self._spec(self.PROBE_LAYERS, d) for d in self.PROBE_WIDTHS]
        counts = [{mm.role(n): p for n, p in zip(spec.layer_names, layer_params(spec))} for spec in specs]
        self.param_fit = {role: [c[role] for c in counts] for role in counts[0]}

    def member(self, label: str) -> dict[str, Any]:
        """The build parameters of the member a row names, e.g. "(18, 208)"."""
        layers, width = (int(x) for x in label.strip("()").split(","))
        return {"layers": layers, "filters": width, **self.fixed}

    def figures_of(self, label: str) -> ModelFigures:
        """The figures of the member a row names."""
        member = self.member(label)
        return self.figures(member["layers"], member["filters"])

    def _spec(self, layers: int, width: int) -> Any:
        return build_model("amoebanet", layers=layers, filters=width, **self.fixed)

    def _params(self, role: str, width: int) -> int:
        """Exact: parameter counts are quadratic in D; interpolate through the three probe widths."""
        (x0, x1, x2), (y0, y1, y2) = self.PROBE_WIDTHS, self.param_fit[role]
        value = (y0 * (width - x1) * (width - x2) / ((x0 - x1) * (x0 - x2))
                 + y1 * (width - x0) * (width - x2) / ((x1 - x0) * (x1 - x2))
                 + y2 * (width - x0) * (width - x1) / ((x2 - x0) * (x2 - x1)))
        return round(value)

    def figures(self, layers: int, width: int) -> ModelFigures:
        """The figures of AmoebaNet-D (layers, width)."""
        d0, d1, _ = self.PROBE_WIDTHS
        # Every tensor of a cell has D-proportional channels, so activation bytes are affine in D.
        t = (width - d0) / (d1 - d0)
        roles = {role: LayerFigures(role, 0, self.at[0][role].saved.blend(self.at[1][role].saved, t),
                                    self.at[0][role].output.blend(self.at[1][role].output, t),
                                    self.at[0][role].saved_input.blend(self.at[1][role].saved_input, t))
                 for role in self.at[0]}
        return _assemble(self._spec(layers, width), roles, self.input, lambda role: self._params(role, width))

    def members(self) -> list[tuple[ModelSpec, ModelFigures, dict[str, Any]]]:
        """The device probe's two small members (6 cells, the two narrowest widths): built, priced, build parameters."""
        return [(build_model("amoebanet", **p), self.figures(6, d), p)
                for d in self.PROBE_WIDTHS[:2] for p in [{"layers": 6, "filters": d, **self.fixed}]]

    def search(self, fits: Callable[[ModelFigures], list[Footprint] | None], least: int = 1) -> Found | None:
        """The fitting member with the most parameters: L by 6s, D by 16s up to the bounds, `least` layers or more."""
        best: Found | None = None
        for layers in range(6, self.max_layers + 1, 6):
            def at(steps: int, layers: int = layers) -> list[Footprint] | None:
                return fits(self.figures(layers, steps * self.WIDTH_STEP))

            lo, found_at = _largest(at, 0, self.max_width // self.WIDTH_STEP + 1)  # widths in units of WIDTH_STEP
            if found_at is None:
                if len(self._spec(layers, self.WIDTH_STEP).layer_names) < least:
                    continue  # too shallow to cut into every chunk
                break  # deeper models only need more
            params = sum(s.params for s in found_at)
            if best is None or params > best.params:
                width = lo * self.WIDTH_STEP
                at_bound = layers > self.max_layers - 6 or width > self.max_width - self.WIDTH_STEP
                bound = f"L up to {self.max_layers} and D up to {self.max_width}" if at_bound else ""
                best = Found(f"({layers}, {width})", params, found_at, bound)
        return best


@dataclass(frozen=True)
class BudgetRow:
    """One scenario's largest model."""

    scenario: str
    partitions: int
    microbatches: int
    checkpoint: str
    model: str
    params: int
    param_memory_bytes: float      # weights + gradients + optimizer state, all stages
    peak_activation_bytes: float   # the stages' activation peaks, summed
    device_peak_bytes: float       # the fullest device
    balance: list[int]
    bound: str = ""                # the search's bound that stopped it before the budget did ("": none)
    schedule: str = "gpipe"
    offload: str = "none"
    measured_device_peak_bytes: float | None = None  # the fullest device of one measured step, where it runs here
    accounted_peak_bytes: float = 0.0  # the fullest device by the accounting alone, before the device correction
    host_peak_bytes: float = 0.0   # the most one device's offloaded activations hold in host memory at once


# Each family as the search grows it, by kind: `GROWN[kind](fixed, seed)`.
GROWN: dict[str, type[TransformerL] | type[AmoebaNetD]] = {"transformer": TransformerL, "amoebanet": AmoebaNetD}


def search_calls(kind: str, scenarios: list[tuple[Any, ...]], schedule: str, virtual: int = 1) -> float:
    """What searching `scenarios` (as `search` takes them) costs, in fixed layer calls."""
    grown = GROWN[kind]
    return sum(grown.V_ROW_CALLS * k if chunks_per_stage(how[0] if how else schedule, virtual, k) > 1
               else grown.ROW_CALLS[0] + grown.ROW_CALLS[1] * k for _, k, _, _, *how in scenarios)


def _balance(stages: list[Footprint], schedule: str) -> list[int]:
    """Layers per chunk, in chunk order, of stages whose chunks are placed as `schedule` says."""
    placed, virtual = schedules.get(schedule).placement, len(stages[0].chunks) or 1
    out = [0] * (len(stages) * virtual)
    for s, stage in enumerate(stages):
        for c, layers in zip(placement.chunks_of(s, len(stages), virtual, placed), stage.chunks or (stage.layers,)):
            out[c] = layers
    return out


def _spread(figures: ModelFigures, stages: int, budget: float, need: Callable[[Footprint], float],
            **priced: Any) -> list[Footprint] | None:
    """Each stage's footprint when the layers are dealt out evenly over `stages` (None: some stage is over)."""
    n = len(figures.layers)
    if n < stages:
        return None
    out, start = [], 0
    for s in range(stages):
        size = n // stages + (s < n % stages)
        out.append(mm.stage_footprint(figures, [range(start, start + size)], s, stages, **priced))
        start += size
    return out if all(need(fp) <= budget for fp in out) else None


# A scenario is (name, K, M, checkpoint), or (..., schedule, offload) where a row has its own; a V-shaped schedule
# cuts 2K chunks.
def search(family: TransformerL | AmoebaNetD, scenarios: list[tuple[Any, ...]], budget: float,
           batch_size: int, schedule: str, optimizer: str, offload: str = "none",
           correction: Correction | None = None, virtual: int = 1) -> list[BudgetRow | None]:
    """The largest fitting member per scenario (None: nothing fits), priced as the device holds it by `correction`."""
    per_param = kept.bytes_per_parameter(optimizer)
    rows: list[BudgetRow | None] = []
    for name, k, m, checkpoint, *how in scenarios:
        placed, moved = how or (schedule, offload)
        moved = moved if name != "naive-1" else "none"  # naive-1 is plain training
        v = 1 if name == "naive-1" else chunks_per_stage(placed, virtual, k)
        # Without a correction a stage needs its total: NONE prices it so.
        need = functools.partial((correction or NONE).bytes, checkpoint=checkpoint)
        common = dict(stages=k, budget=budget, batch_size=batch_size, microbatches=m, schedule=placed,
                      checkpoint=checkpoint, bytes_per_param=per_param, offload=moved, need=need)
        fits = functools.partial(v_fit, **common, virtual=v) if v > 1 else functools.partial(greedy_fit, **common)
        found = family.search(fits, v * k if v > 1 else 1)
        if found is None:
            rows.append(None)
            continue
        stages = found.stages
        if v == 1 and len(stages) < k:  # it fits fewer devices (greedy filled the first): shown on all K, as it runs
            stages = _spread(family.figures_of(found.label), **common) or stages
        rows.append(BudgetRow(name, k, m, checkpoint, found.label, found.params,
                              sum(s.weights_bytes for s in stages), sum(s.peak_bytes for s in stages),
                              max(need(s) for s in stages), _balance(stages, placed), found.bound, placed, moved,
                              accounted_peak_bytes=max(s.total_bytes for s in stages),
                              host_peak_bytes=max(s.host_bytes for s in stages)))
    return rows
