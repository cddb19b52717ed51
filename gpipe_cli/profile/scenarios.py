"""The rows of `gpipe profile-memory` (the paper's Table 1) and how each is obtained: measured or extrapolated."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any

from gpipe_cli import memory_model as mm
from gpipe_cli.errors import UserError
from gpipe_cli.estimate import kept
from gpipe_cli.memory_model import Footprint, ModelFigures
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import microbatch, partition, schedules
from gpipe_cli.sizing import MEMORY_SHARE
from gpipe_cli.units import human_bytes


@dataclass(frozen=True)
class Scenario:
    """One row: its name, K, M and rematerialization, the cut, and whether it is measured (and if not, why)."""

    name: str
    partitions: int
    microbatches: int
    checkpoint: str
    balance: list[int]
    measured: bool
    why: str = ""                 # why it is extrapolated
    figures: ModelFigures | None = None  # the (possibly deepened) figures an extrapolated row is priced from
    offload: str = "none"         # pipeline.offload (never for the naive row: plain training)
    schedule: str = "gpipe"
    virtual: int = 1              # chunks per stage: 2 under a V, V interleaved (the balance then lists K x V chunks)

    def predict(self, figures: ModelFigures, batch: int, per_param: float) -> list[Footprint]:
        """Each stage's bytes by the memory model."""
        return mm.footprints(self.figures or figures, self.balance, batch, self.microbatches, self.schedule,
                             self.checkpoint, per_param, self.virtual, self.offload)


def naive_bytes(figures: ModelFigures, batch: int, per_param: float) -> float:
    """naive-1's bytes by the memory model: the whole model, and the whole batch's activations kept for its backward."""
    naive = Scenario("naive-1", 1, 1, "never", [len(figures.layers)], True)
    return naive.predict(figures, batch, per_param)[0].total_bytes


def names(partitions: list[int], microbatches: int, checkpoint: str) -> list[tuple[str, int, int, str]]:
    """(name, K, M, checkpoint) of every row: naive-1, pipeline-1 and pipeline-K for each K > 1."""
    rows = [("naive-1", 1, 1, "never"), ("pipeline-1", 1, microbatches, checkpoint)]
    return rows + [(f"pipeline-{k}", k, microbatches, checkpoint) for k in dict.fromkeys(partitions) if k > 1]


def flops_balance(spec: ModelSpec, k: int, batch: int, microbatches: int, explicit: str | None) -> list[int]:
    """Layers per chunk (`k` chunks): explicit, or balanced by estimated FLOPs (a cut refused: PartitionError)."""
    layers = len(spec.layers)
    partition.check_partitions(layers, k)
    if explicit:
        try:
            wanted = [int(p) for p in explicit.split(",")]
        except ValueError:
            raise UserError(f"--balance expects layer counts separated by commas, e.g. 5,5 "
                            f"(got '{explicit}')") from None
        return partition.check_balance(wanted, layers, k)
    size = max(microbatch.sizes(batch, microbatches))
    flops = [float(c.flops) for c in kept.summary(spec, size).layers]
    return partition.balance_by_cost(flops if any(flops) else [1.0] * layers, k)


def deepened(figures: ModelFigures, layers: int) -> tuple[ModelFigures, str]:
    """The figures with the most repeated kind of layer repeated until there are `layers`; and which kind."""
    roles = collections.Counter(mm.role(layer.name) for layer in figures.layers)
    kind, _ = roles.most_common(1)[0]
    last = max(i for i, layer in enumerate(figures.layers) if mm.role(layer.name) == kind)
    extra = layers - len(figures.layers)
    copies = tuple(dataclasses.replace(figures.layers[last], name=f"{kind}+{i + 1}") for i in range(extra))
    out = figures.layers[:last + 1] + copies + figures.layers[last + 1:]
    ties = tuple((tuple(i + extra if i > last else i for i in layers), numel) for layers, numel in figures.ties)
    return ModelFigures(figures.input, out, ties), kind


def chunks_per_stage(schedule: str, virtual: int, k: int) -> int:
    """A row's chunks per stage: a V's two at any K; interleaved's V where there are stages to loop over."""
    return 2 if schedules.get(schedule).placement == "v" else virtual if k > 1 else 1


def choose_rows(spec: ModelSpec, figures: ModelFigures, rows: list[tuple[str, int, int, str]], batch: int,
                schedule: str, per_param: float, have: float, explicit: str | None,
                offload: str = "none", virtual: int = 1) -> list[Scenario]:
    """Decide every row before anything is measured: its cut, and measured or extrapolated (and why)."""
    layers = len(spec.layers)
    # An explicit cut is one K's (a single K is profiled then): pipeline-1's chunks under a V are cut by FLOPs.
    cut_k = max(k for _, k, _, _ in rows)
    out = []
    for name, k, m, checkpoint in rows:
        # naive-1 is plain training: no offload and one chunk, whatever the pipeline rows' schedule.
        moved = offload if name != "naive-1" else "none"
        v = 1 if name == "naive-1" else chunks_per_stage(schedule, virtual, k)
        placed = "gpipe" if name == "naive-1" else schedule
        chunks = k * v
        if chunks > layers:
            deeper, kind = deepened(figures, chunks)
            size = max(microbatch.sizes(batch, m))
            what = f"K={k}" if v == 1 else f"K={k} x {v} chunks"
            why = (f"{name} extrapolated: {what} > the {layers} pipeline layers measured ({chunks - layers} more "
                   f"priced as copies of a measured '{kind}')")
            costs = [layer.saved.at(size) + layer.params * per_param for layer in deeper.layers]
            out.append(Scenario(name, k, m, checkpoint, partition.balance_by_cost(costs, chunks), False, why, deeper,
                                moved, placed, v))
            continue
        given = explicit if name != "naive-1" and k == cut_k else None
        balance = flops_balance(spec, chunks, batch, m, given) if chunks > 1 or given else [layers]
        scenario = Scenario(name, k, m, checkpoint, balance, True, offload=moved, schedule=placed, virtual=v)
        fullest = max(fp.total_bytes for fp in scenario.predict(figures, batch, per_param))
        if fullest > have:
            why = (f"{name} extrapolated: its fullest stage needs about {human_bytes(fullest)}, too large for this "
                   f"machine's memory (a measurement may use {human_bytes(have)}, {MEMORY_SHARE:.0%} of what is free)")
            scenario = dataclasses.replace(scenario, measured=False, why=why)
        out.append(scenario)
    return out


def row(scenario: Scenario, stages: list[dict[str, Any]], params: int) -> dict[str, Any]:
    """A row as the JSON file holds it: the stages and the Table 1 totals."""
    return {"name": scenario.name, "partitions": scenario.partitions, "microbatches": scenario.microbatches,
            "checkpoint": scenario.checkpoint, "schedule": scenario.schedule, "virtual": scenario.virtual,
            "balance": scenario.balance, "stages": stages,
            "measured": scenario.measured, "source": "measured" if scenario.measured else "extrapolated",
            "why": scenario.why, "params": params,
            "param_memory_bytes": sum(s["params_bytes"] + s["grads_bytes"] + s["optimizer_bytes"] for s in stages),
            "peak_activation_bytes": sum(s["peak_bytes"] for s in stages),
            "device_peak_bytes": max(s["total_bytes"] for s in stages)}


def predicted_stages(scenario: Scenario, figures: ModelFigures, batch: int, per_param: float) -> list[dict[str, Any]]:
    """An extrapolated row's stages in the measured rows' shape."""
    out = []
    placed = mm.stage_chunks(scenario.balance, scenario.schedule, scenario.virtual)
    for s, (fp, spans) in enumerate(zip(scenario.predict(figures, batch, per_param), placed)):
        weights = fp.params * mm.PARAM_BYTES
        out.append({"stage": s, "first_layer": spans[0].start, "layers": fp.layers, "params_bytes": weights,
                    "grads_bytes": weights, "optimizer_bytes": round(fp.weights_bytes) - 2 * weights,
                    "stored_bytes": round(fp.stored_bytes), "peak_bytes": round(fp.peak_bytes),
                    "total_bytes": round(fp.total_bytes), "host_bytes": round(fp.host_bytes),
                    "chunks": [[r.start, r.stop - 1] for r in spans]})
    return out
