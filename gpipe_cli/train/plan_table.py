"""The plan as a table for the terminal (what `gpipe validate` prints)."""

from __future__ import annotations

from rich.table import Table

from gpipe_cli.train.plan import Plan
from gpipe_cli.units import human_bytes, human_count


def _layers(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]} … {names[-1]} ({len(names)})"


def plan_table(plan: Plan) -> Table:
    """One row per stage: layers, parameters, forward FLOPs, estimated peak memory and whether it fits."""
    table = Table(title=f"{plan.model}: {human_count(plan.total_params)} parameters, {plan.partitions} stages x "
                        f"{plan.data_parallel} replicas, {plan.microbatches} micro-batches of "
                        f"{plan.microbatch_size}", title_justify="left")
    for column in ("stage", "layers", "params", "GFLOPs/example", "memory (est.)", "of which activations",
                   "fits"):
        table.add_column(column, justify="left" if column == "layers" else "right")
    for s in plan.stages:
        fits = "yes" if s.fits else f"[bold red]no: {s.over()}[/]"
        table.add_row(str(s.index), _layers(s.layers), human_count(s.params), f"{s.flops / 1e9:.3f}",
                      human_bytes(s.memory.total), human_bytes(s.memory.activations), fits)
    verdict = "every stage fits" if plan.fits else f"{sum(not s.fits for s in plan.stages)} stage(s) do not fit"
    table.caption = (f"balance {plan.balance} by {plan.balance_by}; schedule {plan.schedule}, "
                     f"rematerialization {plan.checkpoint}; theoretical bubble {plan.bubble_theory:.3f}\n"
                     f"memory: {human_bytes(plan.stages[0].capacity)} per rank ({plan.capacity}): {verdict}")
    return table
