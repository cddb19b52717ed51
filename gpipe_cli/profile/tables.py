"""Print memory profiles for a person (the JSON file holds the same data)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from gpipe_cli.console import figure_table, print_table
from gpipe_cli.models import families
from gpipe_cli.units import human_bytes, human_count, number_range

# The columns that say whose a row is: a table split to fit the terminal repeats them in each part.
KEYS = ("", "stage")

__all__ = ["show_budget", "show_measured"]


def show_measured(s: dict[str, Any], console: Console) -> None:
    """Per-stage tables, one per scenario, and a one-line comparison of the fullest devices."""
    model = s["model"]
    console.print(f"[bold]gpipe profile-memory[/] · {model['name']} ({model['layers']} pipeline layers) · batch "
                  f"{s['batch_size']} · M={s['microbatches']} · {s['schedule']} · checkpoint {s['checkpoint']} · "
                  f"optimizer {s['optimizer']} · device {s['device']}"
                  + (f" · offload {s['offload']}" if s.get("offload", "none") != "none" else ""))
    console.print(f"activations measured by {s['method']}; stored act.: what the forwards keep until the "
                  f"backward phase; peak act.: stored plus the micro-batch being recomputed and backpropagated")
    for sc in (sc for sc in s["scenarios"] if sc["measured"]):
        v = sc.get("virtual", 1)
        shape = f" x V={v} ({sc['schedule']})" if v > 1 else ""
        moved = s.get("offload", "none") != "none"  # under `never` too: its micro-batches' whole forwards wait there
        table = figure_table(f"{sc['name']}: K={sc['partitions']}{shape}, M={sc['microbatches']}, checkpoint "
                             f"{sc['checkpoint']}, balance {sc['balance']}",
                             ("stage", "layers", "params", "grads", "optim.", "stored act.", "peak act.", "total")
                             + (("offloaded to host",) if moved else ()))
        for st in sc["stages"]:
            keys = ("params", "grads", "optimizer", "stored", "peak", "total") + (("host",) if moved else ())
            table.add_row(str(st["stage"]), _layers(st), *(human_bytes(st.get(f"{key}_bytes", 0)) for key in keys))
        print_table(console, table, KEYS)
    print_table(console, _table1(s), KEYS)
    for sc in s["scenarios"]:
        if not sc["measured"]:
            console.print(f"[yellow]{sc['why']}[/]; from per-layer figures ({s['per_layer_figures']})")


def _layers(stage: dict[str, Any]) -> str:
    """The layers a stage holds, e.g. "0-2", or "0-1 · 6-7" for a V's two chunks."""
    chunks = stage.get("chunks") or [[stage["first_layer"], stage["first_layer"] + stage["layers"] - 1]]
    return " · ".join(number_range(first, last) for first, last in chunks)


def _table1(s: dict[str, Any]) -> Table:
    """The paper's Table 1 layout: one column per row of the profile, each saying how it was obtained."""
    rows = s["scenarios"]
    table = figure_table(f"Memory per scenario, {s['model']['name']} (parameters and activations: totals over all "
                         f"stages; fullest device: its own)",
                         ("", *(sc["name"] for sc in rows)), left=("",))
    table.add_row("# of model parameters", *(human_count(sc["params"]) for sc in rows))
    table.add_row("total model parameter memory", *(human_bytes(sc["param_memory_bytes"]) for sc in rows))
    table.add_row("peak activation memory", *(human_bytes(sc["peak_activation_bytes"]) for sc in rows))
    table.add_row("fullest device", *(human_bytes(sc["device_peak_bytes"]) for sc in rows))
    per = "chunk (V per stage)" if any(sc.get("virtual", 1) > 1 for sc in rows) else "stage"
    table.add_row(f"layers per {per}", *(",".join(map(str, sc["balance"])) for sc in rows))
    table.add_row("figures", *("measured" if sc["measured"] else "[yellow]extrapolated[/]" for sc in rows))
    # The same parameters in more bytes: a tied weight (an extrapolated row, of a larger model, counts more of both).
    # An AmoebaNet, which ties nothing, was said to count one (`model.tied`: absent from older files).
    if s["model"].get("tied", True) and len({sc["params"] for sc in rows}) == 1 \
            and len({sc["param_memory_bytes"] for sc in rows}) > 1:
        table.caption = ("parameter memory counts a tied weight (the embedding and softmax) on every stage that "
                         "holds one, so a cut model's can exceed its parameters'")
    return table


def _measured(row: dict[str, Any] | None) -> str:
    """A budget row's measured fullest device and how far the prediction is from it, e.g. "5.1 MiB (pred. +2%)"."""
    if row is None:  # as every other row of that column says
        return "does not fit"
    found = row.get("measured_device_peak_bytes")
    if found is None:
        return "not run here"
    off = row["device_peak_bytes"] / found - 1
    return f"{human_bytes(found)} (pred. {f'{off:+.0%}' if round(off, 2) else '±0%'})"


def show_budget(s: dict[str, Any], console: Console) -> None:
    """The paper's Table 1 layout: one column per scenario, ours above the paper's."""
    # The searched sizes by the letters the table's rows fill in, the fixed ones as every header names a model.
    model = families.of(s["kind"]).title({**s["fixed"], "layers": "L", "filters": "D"}, True)
    console.print(f"[bold]gpipe profile-memory --budget[/] {human_bytes(s['budget_bytes'])} per device · "
                  f"{model} · batch {s['batch_size']} · M={s['microbatches']} · "
                  f"checkpoint {s['checkpoint']} · {s['optimizer']} ({s['bytes_per_param']:.0f} bytes per parameter "
                  f"with its gradient)")
    console.print(f"[dim]{s['method']}[/]")
    table = figure_table(f"Largest {s['family']} per device budget (parameters and activations: totals over all "
                         f"devices; fullest device: its own)",
                         ("", *s["scenarios"]), left=("",))
    rows = s["rows"]

    def cells(key: str, fmt: Any) -> list[str]:
        # A model the search's bound stopped is marked: a larger one would fit the budget too.
        return [f"{fmt(r[key])}{' (bound)' if key == 'model' and r.get('bound') else ''}" if r else "does not fit"
                for r in rows]

    table.add_row(s["family"], *cells("model", str))
    table.add_row("# of model parameters", *cells("params", human_count))
    table.add_row("total model parameter memory", *cells("param_memory_bytes", human_bytes))
    table.add_row("peak activation memory", *cells("peak_activation_bytes", human_bytes))
    table.add_row("fullest device (predicted)", *cells("device_peak_bytes", human_bytes))
    table.add_row("fullest device (measured)", *(_measured(r) for r in rows))
    if any(r and r.get("offload", "none") != "none" for r in rows):
        table.add_row("host memory, fullest device", *cells("host_peak_bytes", lambda b: human_bytes(b) if b else "-"))
    chunked = any(r and len(r["balance"]) > r["partitions"] for r in rows)  # V per stage
    table.add_row(f"layers per {'chunk (V per stage)' if chunked else 'stage'}",
                  *cells("balance", lambda b: ",".join(map(str, b))))
    print_table(console, table, KEYS)
    bounded: dict[str, list[str]] = {}
    for name, r in zip(s["scenarios"], rows):
        if r and r.get("bound"):
            bounded.setdefault(r["bound"], []).append(name)
    for bound, names in bounded.items():
        console.print(f"[yellow]{', '.join(names)}: the search stopped at its bound ({bound}), not at the budget: "
                      f"larger models fit {human_bytes(s['budget_bytes'])} too[/]")
    paper = s["paper"]
    names = list(paper["rows"])
    ptable = figure_table(f"GPipe Table 1, {paper['hardware']} (the paper counts 12 bytes per parameter, RMSProp)",
                          ("", *names), left=("",))
    for i, label in enumerate((s["family"], "# of model parameters", "total model parameter memory",
                               "peak activation memory")):
        ptable.add_row(label, *(paper["rows"][n][i] for n in names))
    print_table(console, ptable, KEYS)
