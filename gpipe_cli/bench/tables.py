"""Print a single-configuration benchmark's figures for a person (the JSON file holds the same data)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from gpipe_cli import contention, plots
from gpipe_cli.bench.options import run_name
from gpipe_cli.console import figure_table, print_table
from gpipe_cli.pipeline import schedules
from gpipe_cli.units import counted, figure, human_bytes, human_count


def k_run(s: dict[str, Any]) -> str:
    """The K ranks' run as its rows name it (`K=1 V=2` beside K=1)."""
    return run_name(s["partitions"], s.get("virtual_stages", 1))


def _throughput(s: dict[str, Any]) -> Table:
    text = s["tokens_per_s_k1"] is not None
    table = figure_table(f"Throughput (median of {counted(s['steps'], 'step')} after {s['warmup']} warm-up)",
                         ("run", "samples/s", *(("tokens/s",) if text else ()), "step (ms)"), left=("run",))
    label = k_run(s) + (" (predicted)" if s["simulated"] else "")
    rows = [("K=1", s["samples_per_s_k1"], s["tokens_per_s_k1"], s["step_time_k1_s"]),
            (label, s["samples_per_s"], s["tokens_per_s"], s["step_time_s"])]
    for name, samples, tokens, step in rows[:1] if s.get("measured_once") else rows:
        table.add_row(name, figure(samples, ",.1f"), *([figure(tokens, ",.1f")] if text else []), f"{step * 1e3:.1f}")
    return table


def _stages(s: dict[str, Any]) -> Table:
    offloaded = s.get("offload", "none") != "none"
    table = figure_table(f"Stages (memory: {s['memory_method']})",
                         ("stage", "layers", "busy (ms)", "step (ms)", "idle", "activation peak")
                         + (("offloaded to host",) if offloaded else ()))
    for st in s["stages"]:
        peak = st["cuda_peak_bytes"] or st["activation_peak_bytes"]
        table.add_row(str(st["stage"]), str(st["layers"]), f"{st['busy_s'] * 1e3:.1f}", f"{st['step_s'] * 1e3:.1f}",
                      f"{st['bubble']:.3f}", human_bytes(peak),
                      *((human_bytes(st.get("offloaded_peak_bytes", 0)),) if offloaded else ()))
    # Each a median over the steps on its own: idle is not 1 - busy / step of the medians beside it.
    table.caption = "each column is its own median over the steps (idle: of each step's 1 - busy / step)"
    return table


def _compare(s: dict[str, Any]) -> Table:
    """One row per figure: ours, torch's counterpart, and ours / theirs."""
    measured = [c for c in s["compare"].values() if "skipped" not in c]
    # Offloading is ours alone: our peaks leave out what waits in host memory, torch's hold everything.
    offload = ("; ours offloads stored activations to host memory (its peaks leave them out), torch's does not"
               if s.get("offload", "none") != "none" else "")
    table = figure_table(f"Against torch.distributed.pipelining (same model, K, M, cut; same clock and meter; same "
                         f"checkpointing: {s['checkpoint']}, whole chunk, each side on its own order of work{offload})",
                         ("figure", f"ours\n{s['schedule']}",
                          *(name for c in measured for name in (f"torch\n{c['class']}", "ours /\ntheirs"))),
                         left=("figure",))

    def row(label: str, mine: Any, key: str, show: Any, stage: int | None = None, ratio: bool = True) -> None:
        """Our figure beside each counterpart's `key` (of `stage`, for a per-stage figure)."""
        cells = [label, show(mine)]
        for c in measured:
            theirs = c[key] if stage is None else c[key][stage]
            cells += [show(theirs), f"{mine / theirs:.2f}x" if ratio and theirs else "-"]
        table.add_row(*cells)

    row("samples/s", s["samples_per_s"], "samples_per_s", lambda v: figure(v, ",.1f"))
    row("idle (mean)", s["bubble"], "bubble", lambda v: f"{v:.3f}")
    for stage, peak in enumerate(s.get("stage_peak_bytes", [])):
        row(f"peak, stage {stage}", peak, "stage_peak_bytes", human_bytes, stage)
    for stage, count in enumerate(measured[0]["stage_recomputed_ours"] if measured else []):
        row(f"recomputed, stage {stage}", count, "stage_recomputed", str, stage, ratio=False)
    return table


GRADIENTS_AGREE = 1e-4  # relative: float sums in another order, not another computation


def host_overhead(s: dict[str, Any]) -> str:
    """The K=1 engine against a plain loop over the same layers (see `gpipe_cli.bench.overhead`), in one line."""
    h = s.get("host_overhead")
    if h is None:
        return ("host overhead: measured at K=1 only (gpipe bench --partitions 1, on a model small enough that "
                "its arithmetic is negligible)")
    threads = counted(h['threads'], 'thread')
    # A negative overhead (the engine measured faster: noise, or a loaded machine) is said as a saving.
    verb = "adds" if h["overhead_step_s"] >= 0 else "saves"
    return (f"host overhead (K={h['partitions']}, M={h['microbatches']}): engine {h['engine_step_s'] * 1e3:.1f} "
            f"ms/step, plain loop {h['plain_step_s'] * 1e3:.1f} ms/step ({h['plain_over_engine']:.2f}x): the engine "
            f"{verb} {abs(h['overhead_step_s']) * 1e3:.1f} ms a step, {abs(h['overhead_per_microbatch_s']) * 1e3:.2f} "
            f"ms per micro-batch (best of {h['rounds'] * h['steps_per_round']} steps each in {h['rounds']} alternating "
            f"rounds, no optimizer step, {threads})"
            + (f"; the two sides' gradients differ by up to {h['gradient_max_relative_difference']:.1e} of the "
               f"largest, where they should agree: the figures may not compare like with like"
               if h["gradient_max_relative_difference"] > GRADIENTS_AGREE else ""))


def show(s: dict[str, Any], console: Console) -> None:
    """Print the figures."""
    model = s["model"]
    console.print(f"[bold]gpipe bench[/] · {model['name']} ({human_count(model['parameters'])} parameters, "
                  f"{model['layers']} pipeline layers) · {k_run(s)} M={s['microbatches']} · batch "
                  f"{s['batch_size']} · {s['schedule']} · checkpoint {s['checkpoint']} · balance {s['balance']} "
                  f"({s['balance_by']})")
    if s["oversubscribed"]:
        console.print(f"[bold yellow]OVERSUBSCRIBED:[/] {s['ranks']} ranks x {s['threads']} thread(s) on "
                      f"{s['hardware']}; the speed figures below mean little")
    if s.get("contended"):
        runs = {"k1": "K=1", "k": k_run(s)}  # then the host overhead's and the baselines'
        console.print(contention.note({runs.get(run, run): load for run, load in s["load"].items()}))
    console.print(_throughput(s))
    kind = "PREDICTION: simulated, not measured" if s["simulated"] else "measured"
    console.print(f"normalised throughput T(K)/T(1) = [bold]{s['normalized']:.2f}[/] ({kind}); "
                  f"ideal K·(1 - bubble in theory) = {s['ideal']:.2f}; efficiency = [bold]{s['efficiency']:.3f}[/]")
    schedule = s.get("schedule", "gpipe")
    theory = schedules.get(schedule).bubble_formula or f"of {schedule}"
    console.print(f"bubble: {'predicted' if s['simulated'] else 'measured'} [bold]{s['bubble']:.3f}[/], "
                  f"theory {theory} = {s['bubble_theory']:.3f}")
    if "host_overhead" in s:
        console.print(host_overhead(s), highlight=False)
    if s["stages"]:
        print_table(console, _stages(s), ("stage",))  # a narrow terminal splits it, each part naming the stages
    p = s["prediction"]
    if not s["simulated"]:  # the simulator's prediction beside the measurement of the same configuration
        ratio = s["samples_per_s"] / p["samples_per_s"] if p["samples_per_s"] else 0.0
        shared = "; the prediction gives every rank its own core or GPU, which they share here"
        console.print(f"simulator vs measurement ({s['schedule']}): predicted {p['samples_per_s']:,.1f} samples/s, "
                      f"bubble {p['bubble']:.3f}; measured {s['samples_per_s']:,.1f} samples/s, bubble "
                      f"{s['bubble']:.3f}; measured / predicted throughput [bold]{ratio:.2f}[/] (calibration "
                      f"x{p['calibration']:.2f}; links of {p['bandwidth_gb_s']} GB/s, {p['latency_us']} µs a message "
                      "assumed: --bandwidth, --latency-us)" + (shared if s["oversubscribed"] else ""))
        if (busy := p.get("from_stage_busy")) is not None:  # the schedule alone, the stages' measured compute given
            console.print(f"  with each stage's measured busy time: predicted {busy['samples_per_s']:,.1f} samples/s, "
                          f"bubble {busy['bubble']:.3f}; measured / predicted [bold]"
                          f"{busy['measured_over_predicted']:.2f}[/]")
    else:
        console.print(f"[bold yellow]PREDICTION[/] for {counted(p['partitions'], 'device')} linked at "
                      f"{p['bandwidth_gb_s']} GB/s, {p['latency_us']} µs per message, from per-layer costs measured "
                      f"here (calibrated x{p['calibration']:.2f} to the measured K=1 step)")
    if any("skipped" not in c for c in s.get("compare", {}).values()):
        console.print(_compare(s))
    for name, c in s.get("compare", {}).items():
        if "skipped" in c:
            console.print(f"{name}: not measured ({c['skipped']})")
    if "trace" in s:
        t = s["trace"]
        png = t["png"] or f"no PNG: {plots.why_not()}"
        console.print(f"trace: {t['events']} actions -> {t['chrome']} (Perfetto / chrome://tracing), {png}",
                      markup=False)
