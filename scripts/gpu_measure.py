"""Measurements of the GPU acceptance that no `gpipe` command makes; each writes its figures as JSON.

    overhead   samples/s of the engine at K=1 against a plain PyTorch loop with gradient accumulation
               over the same micro-batches (per-layer torch.utils.checkpoint where the engine
               rematerializes), bf16 autocast and fp32, per batch, M and checkpoint mode; and the CUDA
               synchronisations of one engine step (torch.cuda.set_sync_debug_mode("warn"))
    fits       train one step of each largest model `gpipe profile-memory --budget` found, on the
               GPU, and read the CUDA allocator's peak (or the out-of-memory error) against the
               predicted; with --extra also V-Half and offload rows, and the goals: the largest remat
               model peaks within 5% below the budget, offload fits 1.3x its parameters
    messages   seconds per message between two ranks sharing one GPU (device -> host -> gloo ->
               host -> device) against the same messages between two CPU ranks
    multigpu   `gpipe train` at K=2 under torchrun on two GPUs (NCCL): each schedule with messages
               between stages over 8 MiB, K=2 x D=2 on four GPUs, and a translation model evaluated
               with greedy decoding (BLEU); exit codes, finite losses and seconds per run

Every subcommand takes --device (default cuda); --device cpu runs the same code on the CPU at
whatever sizes are given, to check the measurement itself on a machine without a GPU.

Usage: python scripts/gpu_measure.py {overhead,fits,messages,multigpu} [options] --json FILE
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint as checkpointed

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate.subject import example_batch, resolve
from gpipe_cli.models.registry import build_model
from gpipe_cli.pipeline import microbatch, topology
from gpipe_cli.pipeline.comm import Inbound, Outbound, Transport
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.fabric import FORWARD, Link, TorchFabric
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.profile import budget, probe
from gpipe_cli.train import profiling

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
# The goals of the engine's overhead (reported, not asserted): (M, checkpoint) -> engine / plain loop.
OVERHEAD_GOALS = {(1, "never"): 0.99, (4, "except_last"): 0.97}


def _device(args: argparse.Namespace) -> torch.device:
    """The device a subcommand measures on: cuda:0 (refused without a GPU) or the CPU."""
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_measure: no CUDA GPU is visible (give --device cpu to check the measurement on the CPU)")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def cuda_ready(device: torch.device) -> None:
    """Create the CUDA context and the allocator's state on `device`: resetting or reading the allocator's
    peak before the first allocation fails with "Invalid device argument"."""
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return tuple(_to(b, device) for b in batch)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# ----------------------------------------------------------------------------------------- overhead

class Side:
    """One side of the overhead comparison: a training step (forward and backward of one mini-batch as
    M micro-batches, gradients left in place) and its parameters."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], step: Callable[[Any, torch.Tensor, int], float]):
        self.name, self.params, self._step = name, params, step

    def run(self, inputs: Any, targets: torch.Tensor, microbatches: int, device: torch.device) -> tuple[float, float]:
        """One step from dropped gradients to the device being idle: (seconds, mean loss)."""
        _sync(device)
        start = time.perf_counter()
        for p in self.params:
            p.grad = None
        loss = self._step(inputs, targets, microbatches)
        _sync(device)
        return time.perf_counter() - start, loss


def engine_side(spec: Any, device: torch.device, precision: str, checkpoint: str, seed: int) -> Side:
    """The engine at K=1 (one stage holding every layer), as `gpipe train` builds it."""
    n = len(spec.layers)
    pipe = Pipeline(build_layers(spec.factories(), range(n), seed, device), topology.local(device),
                    PipelineConfig(checkpoint=checkpoint, balance=(n,)), spec.loss, units=spec.units,
                    precision=precision)
    counter = iter(range(1 << 62))

    def step(inputs: Any, targets: torch.Tensor, microbatches: int) -> float:
        # As training runs 9 steps in 10: without counting every stored activation (train.memory_every).
        result = pipe.train_step(inputs, targets, microbatches=microbatches, step=next(counter),
                                 measure_memory=False)
        return float("nan") if result.loss is None else float(result.loss)

    return Side("engine", list(pipe.parameters()), step)


def plain_side(spec: Any, device: torch.device, precision: str, checkpoint: str, seed: int) -> Side:
    """What one writes by hand: the same layers (same seed, same weights) and micro-batches (sizes as
    gpipe_cli/pipeline/microbatch.py cuts them), each micro-batch's loss weighted by its share of the
    mini-batch's units (tokens) as the engine weights it, backward per micro-batch (gradient
    accumulation); with checkpoint except_last every layer of every micro-batch but the last runs
    under torch.utils.checkpoint (use_reentrant=False), with always every micro-batch's."""
    n = len(spec.layers)
    layers = build_layers(spec.factories(), range(n), seed, device)
    for layer in layers:
        layer.train()
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def units(target: torch.Tensor) -> float:
        return float(spec.units(target)) if spec.units is not None else float(target.shape[0])

    def step(inputs: Any, targets: torch.Tensor, microbatches: int) -> float:
        split = microbatch.sizes(microbatch.batch_size(inputs), microbatches)
        parts = microbatch.scatter(_to(inputs, device), microbatches)  # the engine's split, on the device
        labels = targets.split(split)
        counts = [units(t) for t in labels]  # on the CPU, as the engine counts them: no synchronisation
        total = sum(counts)
        losses = []
        for index, (x, y, count) in enumerate(zip(parts, labels, counts)):
            remat = checkpoint == "always" or (checkpoint == "except_last" and index < microbatches - 1)
            autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                        else contextlib.nullcontext())
            with autocast:
                for layer in layers:
                    x = checkpointed(layer, x, use_reentrant=False) if remat else layer(x)
                loss = spec.loss(x, y.to(device, non_blocking=True)) * (count / total)
            loss.backward()
            losses.append(loss.detach())
        return float(torch.stack(losses).sum())  # the loss a loop logs: one synchronisation, as the engine's

    return Side("plain", params, step)


def _median_step(side: Side, inputs: Any, targets: torch.Tensor, microbatches: int, steps: int,
                 device: torch.device) -> tuple[float, float]:
    times, loss = [], float("nan")
    for _ in range(steps):
        seconds, loss = side.run(inputs, targets, microbatches, device)
        times.append(seconds)
    return statistics.median(times), loss


def compare(engine: Side, plain: Side, inputs: Any, targets: torch.Tensor, batch: int, microbatches: int,
            steps: int, warmup: int, rounds: int, device: torch.device, round_s: float = 0.0) -> dict[str, Any]:
    """Warm both sides up, then alternate rounds (engine, plain, engine, ...) of `steps` steps, or more
    where a step is short: enough for `round_s` seconds by the last warm-up step's time (at most 50);
    each side's best round (the lowest median step time) gives its samples/s."""
    last = 0.0
    for side in (engine, plain):
        for _ in range(warmup):
            seconds, _ = side.run(inputs, targets, microbatches, device)
            last = max(last, seconds)
    if round_s > 0 and last > 0:
        steps = max(steps, min(50, math.ceil(round_s / last)))
    best = {"engine": math.inf, "plain": math.inf}
    losses = {"engine": math.nan, "plain": math.nan}
    for _ in range(rounds):
        for side in (engine, plain):
            seconds, losses[side.name] = _median_step(side, inputs, targets, microbatches, steps, device)
            best[side.name] = min(best[side.name], seconds)
    engine_rate, plain_rate = batch / best["engine"], batch / best["plain"]
    gap = abs(losses["engine"] - losses["plain"]) / max(abs(losses["plain"]), 1e-12)
    return {"engine_samples_per_s": engine_rate, "plain_samples_per_s": plain_rate,
            "ratio": engine_rate / plain_rate, "engine_step_s": best["engine"], "plain_step_s": best["plain"],
            "engine_loss": losses["engine"], "plain_loss": losses["plain"], "loss_gap": gap, "steps_per_round": steps}


def overhead_configs(precisions: list[str], batches: list[int], microbatches: list[int],
                     remats: list[str]) -> list[tuple[str, int, int, str]]:
    """(precision, batch, M, checkpoint) to measure, the goals' first (so that a time budget that runs
    out drops the others): M=1 runs without rematerialization (the only micro-batch is the last);
    M > batch cannot be cut."""
    configs = []
    for precision in precisions:
        for batch in batches:
            for m in microbatches:
                if m > batch:
                    continue
                for remat in (["never"] if m == 1 else remats):
                    configs.append((precision, batch, m, remat))
    return sorted(configs, key=lambda c: (OVERHEAD_GOALS.get((c[2], c[3])) is None, precisions.index(c[0])))


# A row's time over the longest measured row of its precision and batch: rematerialization recomputes a forward
# (4 passes against 3), and a new pair of models is built when the checkpoint mode changes.
ROW_MARGIN = 1.5


def row_seconds(precision: str, batch: int, rows: list[dict[str, Any]]) -> float:
    """Seconds the longest measured row of this precision and batch took: what the next should take."""
    # Before any, the longest at the nearest batch measured of its precision (else of any), scaled up to a larger
    # batch; 0 before any row at all.
    # Priced at 0, fp32's first row at batch 128 started 55 s in and ran some 9 s past the step's bound.
    kin = [r for r in rows if r["precision"] == precision] or rows
    if not kin:
        return 0.0
    nearest = min({r["batch_size"] for r in kin}, key=lambda b: (abs(b - batch), b))
    return max(r["seconds"] for r in kin if r["batch_size"] == nearest) * max(1.0, batch / nearest)


def sync_warnings(side: Side, inputs: Any, targets: torch.Tensor, microbatches: int,
                  device: torch.device) -> dict[str, Any]:
    """One step (after a warm-up step, not counted) under torch.cuda.set_sync_debug_mode("warn"): the
    warnings it raised, i.e. the host waiting for the GPU, and where (off CUDA: none can be raised)."""
    side.run(inputs, targets, microbatches, device)  # warm-up: first-call allocations and caches
    _sync(device)
    if device.type == "cuda":  # its first use warns that the mode is a prototype: not a synchronisation
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cuda.set_sync_debug_mode("warn")
            torch.cuda.set_sync_debug_mode("default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            side.run(inputs, targets, microbatches, device)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"side": side.name, "microbatches": microbatches, "batch_size": microbatch.batch_size(inputs),
            "per_step": len(syncs), "where": dict(where.most_common(8)),
            "messages": sorted({str(w.message).splitlines()[0][:160] for w in syncs})[:3],
            "mode": "warn" if device.type == "cuda" else "not available off CUDA"}


def host_profile(side: Side, inputs: Any, targets: torch.Tensor, device: torch.device, top: int = 12) -> dict[str, Any]:
    """One step at M=1 (after a warm-up step) under torch's profiler, host side only: the step's wall time, the
    host time of its top-level operators (the rest is Python) and the operators that took the most."""
    side.run(inputs, targets, 1, device)
    with profiling.quiet():  # Kineto's own lines at its start and stop
        # The profiler's first use pays its own start (300 ms against 23 ms, seen): taken by a step not kept.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            side.run(inputs, targets, 1, device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            seconds, _ = side.run(inputs, targets, 1, device)
    events = top_level(prof.events())
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.cpu_time_total / 1e6)
    heaviest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"side": side.name, "batch_size": microbatch.batch_size(inputs), "step_s": seconds,
            "operators_s": sum(e.cpu_time_total for e in events) / 1e6, "operators": len(events),
            "heaviest": [{"name": name, "calls": len(ts), "seconds": sum(ts)} for name, ts in heaviest]}


def top_level(events: Any) -> list[Any]:
    """The operators not inside another (nested ones are counted in theirs), inside the engine's named ranges too."""
    # The engine names each action's range (`fwd mb0`) when a profiler records: as top-level events, they made its
    # operators 36 against the loop's 265, and its heaviest "bwd mb0".
    def annotation(event: Any) -> bool:
        return bool(getattr(event, "is_user_annotation", False))

    found = []
    for event in events:
        parent = event.cpu_parent
        while parent is not None and annotation(parent):
            parent = parent.cpu_parent
        if parent is None and not annotation(event):
            found.append(event)
    return found


def keep(path: Path | None, figures: dict[str, Any]) -> None:
    """Write what is measured so far, whole (a step stopped at its bound leaves its rows)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(figures, indent=2))
    partial.replace(path)


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """The engine at K=1 against the hand-written loop, per (precision, batch, M, checkpoint)."""
    device = _device(args)
    cuda_ready(device)
    sizes = {"layers": args.layers, "d_model": args.d_model, "ff": args.ff, "heads": args.heads,
             "vocab_size": args.vocab_size, "seq_len": args.seq_len}
    # Dropout 0: outside the engine dropout is torch's; inside, masks are drawn per example.
    subject = resolve("transformer", sizes, ["arch=decoder-only", "dropout=0"])
    spec = subject.build()
    batches, precisions = _ints(args.batches), [p for p in args.precisions.split(",") if p]
    configs = overhead_configs(precisions, batches, _ints(args.microbatches),
                               [r for r in args.checkpoint.split(",") if r])
    data = {b: example_batch(spec, b, args.seed) for b in sorted({c[1] for c in configs} | {args.sync_batch})}
    started = time.perf_counter()
    out: dict[str, Any] = {
        "model": {**subject.to_json(), "name": spec.name, "layers": len(spec.layers)}, "device": _device_name(device),
        "seq_len": args.seq_len, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
        "round_s": args.round_s,
        "method": "best round's median step time, engine and plain loop alternating, gradients dropped each step",
        "fp32_matmul": "TF32 allowed" if torch.backends.cuda.matmul.allow_tf32 else "full fp32 (torch's default)",
        "goals": {f"M={m} {r}": g for (m, r), g in OVERHEAD_GOALS.items()}, "rows": [], "not_measured": []}

    sides: dict[tuple[str, str], tuple[Side, Side]] = {}

    def pair(precision: str, remat: str) -> tuple[Side, Side]:
        if (precision, remat) not in sides:
            sides.clear()  # one pair of models at a time
            gc.collect()
            sides[precision, remat] = (engine_side(spec, device, precision, remat, args.seed),
                                       plain_side(spec, device, precision, remat, args.seed))
        return sides[precision, remat]

    # Synchronisations of one step, bf16 (or the first precision), as a GPU user trains.
    precision = "bf16" if "bf16" in precisions else precisions[0]
    inputs, targets = data[args.sync_batch]
    out["sync_debug"] = [{**sync_warnings(side, inputs, targets, m, device), "precision": precision,
                          "checkpoint": "except_last"}
                         for m in sorted({1, args.sync_microbatches}) for side in pair(precision, "except_last")]
    keep(args.json, {**out, "partial": True})
    print("gpu_measure overhead: synchronisations per step: "
          + ", ".join(f"{r['side']} M={r['microbatches']} {r['per_step']}" for r in out["sync_debug"]), flush=True)

    # Where the host's time of a short step goes (the engine trails the loop most at the smallest batch).
    small = min(c[1] for c in configs)
    out["host_profile"] = [{**host_profile(side, *data[small], device), "precision": precision}
                           for side in pair(precision, "never")]
    print("gpu_measure overhead: host time of one step, " + ", ".join(
        f"{r['side']} {r['step_s'] * 1e3:.1f} ms ({r['operators']} operators {r['operators_s'] * 1e3:.1f} ms)"
        for r in out["host_profile"]) + f" ({precision}, batch {small}, M=1)", flush=True)
    print(f"{'precision':>9} {'batch':>5} {'M':>3} {'checkpoint':>11} {'engine/s':>10} {'plain/s':>10} {'ratio':>6}",
          flush=True)
    for precision, batch, m, remat in configs:
        if args.budget_s and (time.perf_counter() - started
                              + ROW_MARGIN * row_seconds(precision, batch, out["rows"]) > args.budget_s):
            out["not_measured"].append({"precision": precision, "batch_size": batch, "microbatches": m,
                                        "checkpoint": remat, "why": f"would end past the {args.budget_s:g} s budget"})
            continue
        row_started = time.perf_counter()
        engine, plain = pair(precision, remat)
        inputs, targets = data[batch]
        figures = compare(engine, plain, inputs, targets, batch, m, args.steps, args.warmup, args.rounds, device,
                          args.round_s)
        goal = OVERHEAD_GOALS.get((m, remat))
        row = {"precision": precision, "batch_size": batch, "microbatches": m, "checkpoint": remat, **figures,
               "goal": goal, "meets_goal": None if goal is None else figures["ratio"] >= goal,
               "seconds": time.perf_counter() - row_started}
        out["rows"].append(row)
        keep(args.json, {**out, "partial": True})
        print(f"{precision:>9} {batch:>5} {m:>3} {remat:>11} {figures['engine_samples_per_s']:>10.1f} "
              f"{figures['plain_samples_per_s']:>10.1f} {figures['ratio']:>6.3f}"
              + ("" if goal is None else f"  (goal {goal})"), flush=True)
    if out["not_measured"]:
        print(f"gpu_measure overhead: {len(out['not_measured'])} configuration(s) not measured: they would end "
              f"past the {args.budget_s:g} s budget", flush=True)
    out["seconds"] = time.perf_counter() - started
    return out


# --------------------------------------------------------------------------------------------- fits

def _model_of(kind: str, label: str, fixed: dict[str, Any]) -> Any:
    """The family member a `--budget` row names: "(L, D)" for AmoebaNet-D, "L" for Transformer-L."""
    if kind == "amoebanet":
        match = re.fullmatch(r"\((\d+), (\d+)\)", label)
        if match is None:
            raise SystemExit(f"gpu_measure: cannot read the AmoebaNet-D size '{label}'")
        return build_model("amoebanet", layers=int(match.group(1)), filters=int(match.group(2)), **fixed)
    return build_model("transformer", layers=int(label), **fixed)


def _reset_peak(device: torch.device) -> int:
    """Reset the allocator's peaks; what it reserves now (the base of the reserved peak)."""
    if device.type != "cuda":
        return 0
    cuda_ready(device)  # the allocator must exist before its peak is reset
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_reserved(device))


def _peaks(device: torch.device, base: int) -> dict[str, Any]:
    """The CUDA allocator's allocated and reserved peaks (the reserved one above `base`: what the card had to
    give, as `gpipe profile-memory --budget` predicts it); on the CPU the process's peak resident memory."""
    if device.type == "cuda":
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                "reserved_peak_bytes": int(torch.cuda.max_memory_reserved(device)) - base}
    return {"peak_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "reserved_peak_bytes": None}


def _measured(outcome: dict[str, Any]) -> float:
    """The peak a prediction is compared with: the reserved one on CUDA, the engine's accounting on the CPU."""
    return float(outcome.get("reserved_peak_bytes") or outcome.get("accounted_bytes") or outcome["peak_bytes"])


def _one_step(spec: Any, batch: int, microbatches: int, checkpoint: str, optimizer: str, device: torch.device,
              schedule: str = "gpipe", balance: tuple[int, ...] = (), virtual: int = 1,
              offload: str = "none") -> dict[str, Any]:
    """One training step and optimizer step at K=1 (V chunks of `balance` on the one device); the allocator's
    peaks and the host's offloaded peak, or the error."""
    n = len(spec.layers)
    gc.collect()
    base = _reset_peak(device)
    started = time.perf_counter()
    pipe = opt = None
    try:
        pipe = Pipeline(build_layers(spec.factories(), range(n), 0, device), topology.local(device),
                        PipelineConfig(checkpoint=checkpoint, balance=balance or (n,), schedule=schedule,
                                       virtual=virtual, microbatches=microbatches, offload=offload),
                        spec.loss, units=spec.units)
        opt = mm.primed(optimizer, list(pipe.parameters()))  # held through the step, as from a second step on
        inputs, targets = example_batch(spec, batch, 0)
        step = pipe.train_step(inputs, targets, microbatches=microbatches, step=0)
        opt.step()
        _sync(device)
        params = sum(p.numel() for p in pipe.parameters() if p.requires_grad)
        # The CPU's meter: the engine's saved-tensor accounting, with the weights, gradients and optimizer state.
        accounted = None if step.own is None else params * mm.bytes_per_parameter(optimizer) + step.own.activation_peak
        result: dict[str, Any] = {"trained": True, "accounted_bytes": accounted,
                                  "host_peak_bytes": pipe.stage.meter.host_peak}
    except RuntimeError as exc:  # the allocator's OutOfMemoryError, or cuBLAS/cuDNN failing to allocate
        if "out of memory" not in str(exc).lower():
            raise
        result = {"trained": False, "error": str(exc).splitlines()[0]}
    result.update(_peaks(device, base), seconds=time.perf_counter() - started)
    pipe = opt = None  # noqa: F841 (dropped before the next model is built)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _versus(predicted: float | None, outcome: dict[str, Any], budget: float) -> dict[str, Any]:
    """A row's predicted peak (None: the table has none) against its measured one."""
    measured = _measured(outcome)
    return {"predicted_bytes": predicted, "measured_bytes": measured,
            "ratio": predicted / measured if predicted is not None and measured > 0 else None,
            "within_budget": bool(outcome["trained"]) and measured <= budget}


# The acceptance's goals for the Table 1 rows (reported in figures.json, never failing the step).
WITHIN_BUDGET = 0.05   # the largest remat Transformer peaks within 5% below the budget
OFFLOAD_GAIN = 1.3     # offload fits at least 1.3x the parameters of remat alone


def extra_rows(table: dict[str, Any], rows: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """V-Half (the remat row's model as two chunks on the one device) and offload (the largest model with
    `pipeline.offload: activations` on the one device), each predicted and measured; and the goals."""
    correction = probe.from_json(table.get("correction"))
    per_param = mm.bytes_per_parameter(table["optimizer"])
    budget_bytes, batch, schedule = table["budget_bytes"], table["batch_size"], table.get("schedule", "gpipe")
    remat = next((r for r in rows if r["scenario"] == "pipeline-1"), None)
    out: dict[str, Any] = {"rows": [], "checks": {}}
    if remat is None:
        out["checks"]["remat_within_5pct"] = {"passed": None, "why": "no pipeline-1 row fits the budget"}
        return out
    m, checkpoint = remat["microbatches"], remat["checkpoint"]
    measured = _measured(remat)
    out["checks"]["remat_within_5pct"] = {
        "passed": bool(remat["trained"]) and (1 - WITHIN_BUDGET) * budget_bytes <= measured <= budget_bytes,
        "measured_bytes": measured, "budget_bytes": budget_bytes, "model": remat["model"]}
    # V-Half: the same model as two chunks on one device, each micro-batch's forward down and back up the V.
    spec = _model_of(table["kind"], remat["model"], table["fixed"])
    n = len(spec.layers)
    balance = ((n + 1) // 2, n // 2)
    print(f"gpu_measure: v-half: {table['family']} {remat['model']} as chunks {balance}, training one step...",
          flush=True)
    figures = mm.measure(spec, 0, device="meta")
    predicted = correction.bytes(mm.footprints(figures, list(balance), batch, m, "v-half", checkpoint, per_param,
                                               virtual=2)[0], checkpoint)
    outcome = _one_step(spec, batch, m, checkpoint, table["optimizer"], device, "v-half", balance, 2)
    out["rows"].append({"scenario": "v-half-1", "schedule": "v-half", "virtual_stages": 2, "partitions": 1,
                        "microbatches": m, "checkpoint": checkpoint, "model": remat["model"], "params": remat["params"],
                        "balance": list(balance), **outcome, **_versus(predicted, outcome, budget_bytes)})
    # Offload against remat alone on the one device: the largest of each by the corrected prediction (per-layer
    # figures from shapes), the offload one trained by the engine, its copies on a side stream.
    family = budget.TransformerL(table["fixed"], shapes_only=True)
    scenario = [("pipeline-1", 1, m, checkpoint)]
    alone, moved = (budget.search(family, scenario, budget_bytes, batch, schedule, table["optimizer"], offload,
                                  correction)[0] for offload in ("none", "activations"))
    if alone is None or moved is None:
        out["checks"]["offload_gain"] = {"passed": None, "why": "nothing fits on one device"}
        return out
    spec = _model_of(table["kind"], moved.model, table["fixed"])
    print(f"gpu_measure: offload: {table['family']} {moved.model} on one device, training one step...", flush=True)
    outcome = _one_step(spec, batch, m, checkpoint, table["optimizer"], device, schedule, offload="activations")
    out["rows"].append({"scenario": "offload-1", "schedule": schedule, "partitions": 1, "offload": "activations",
                        "microbatches": m, "checkpoint": checkpoint, "model": moved.model, "params": moved.params,
                        "balance": moved.balance, "predicted_host_bytes": moved.host_peak_bytes, **outcome,
                        **_versus(moved.device_peak_bytes, outcome, budget_bytes)})
    gain = moved.params / alone.params
    out["checks"]["offload_gain"] = {"passed": gain >= OFFLOAD_GAIN and out["rows"][-1]["within_budget"],
                                     "gain": gain, "goal": OFFLOAD_GAIN, "offload_model": moved.model,
                                     "remat_model": alone.model, "partitions": 1}
    return out


def fits(args: argparse.Namespace) -> dict[str, Any]:
    """Train every row of a `profile-memory --budget` JSON file on the GPU, as the row says, each predicted
    against measured (with --extra: the V-Half and offload rows, and the goals)."""
    device = _device(args)
    cuda_ready(device)
    table = json.loads(Path(args.table).read_text())
    rows = []
    for row in table["rows"]:
        # One device, the table's own schedule: the budget's variant columns (without remat, offloaded, V-Half
        # at the largest K) are left to --extra, which trains its own V-Half and offload rows.
        if row is None or row["partitions"] != 1 or row["scenario"].startswith("K="):
            continue
        spec = _model_of(table["kind"], row["model"], table["fixed"])
        print(f"gpu_measure: {row['scenario']}: {table['family']} {row['model']}, training one step...", flush=True)
        outcome = _one_step(spec, table["batch_size"], row["microbatches"], row["checkpoint"], table["optimizer"],
                            device)
        rows.append({**row, **outcome, "budget_bytes": table["budget_bytes"], "schedule": table.get("schedule"),
                     **_versus(row.get("device_peak_bytes"), outcome, table["budget_bytes"])})
        keep(args.json, {"family": table["family"], "rows": rows, "partial": True})
    peak = ("CUDA allocator peaks (torch.cuda.max_memory_allocated, and max_memory_reserved above the start: "
            "measured_bytes)" if device.type == "cuda"
            else "the process's peak resident memory; measured_bytes: the engine's saved-tensor accounting (CPU)")
    out = {"family": table["family"], "kind": table["kind"], "batch_size": table["batch_size"],
           "optimizer": table["optimizer"], "device": _device_name(device), "correction": table.get("correction"),
           "method": f"{peak} over one step and optimizer step", "rows": rows}
    if args.extra:
        extra = extra_rows(table, rows, device)
        out.update(rows=rows + extra["rows"], checks=extra["checks"])
    return out


# ----------------------------------------------------------------------------------------- messages

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _message_rank(rank: int, port: int, device_type: str, sizes: list[int], count: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # What ranks sharing a GPU use: gloo, payloads through pinned host memory.
    fabric = TorchFabric(device, nccl=False, control=None)
    link = Link(0, 1, FORWARD)
    fabric.open([link], [])
    transport = Transport(device, fabric, staging=device.type == "cuda")
    seconds = {}
    for size in sizes:
        payload = torch.randn(size // 4, device=device)
        channel: Outbound | Inbound = Outbound(transport, link) if rank == 0 else Inbound(transport, link)
        for _ in ("warm-up", "measured"):  # the first step learns the sizes to post ahead, as training does
            channel.begin_step()
            dist.barrier()
            start = time.perf_counter()
            if isinstance(channel, Outbound):
                for mb in range(count):
                    channel.send(mb, count, 0, [payload])
                channel.flush()
            else:
                channel.expect(count)
                for mb in range(count):
                    channel.take(mb)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        seconds[size] = elapsed / count
    if rank == 1:
        Path(out).write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


def messages(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per message of each size, staged through host memory on one GPU and between CPU ranks
    (with --device cpu: between CPU ranks only)."""
    device = _device(args)
    sizes = _ints(args.sizes)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for device_type in (("cuda", "cpu") if device.type == "cuda" else ("cpu",)):
            out = os.path.join(folder, f"{device_type}.json")
            mp.spawn(_message_rank, args=(_free_port(), device_type, sizes, args.count, out), nprocs=2, join=True)
            rows[device_type] = json.loads(Path(out).read_text())
    table = []
    for size in sizes:
        host = rows["cpu"][str(size)]
        staged = rows["cuda"][str(size)] if "cuda" in rows else None
        table.append({"bytes": size, "gpu_shared_s": staged, "cpu_gloo_s": host,
                      "staging_cost_s": None if staged is None else staged - host,
                      "gpu_shared_gb_s": None if staged is None else size / staged / 1e9})
    return {"count": args.count, "device": _device_name(device),
            "transport": "gloo through host memory (ranks sharing one GPU) vs gloo on CPU", "messages": table}


# ----------------------------------------------------------------------------------------- multigpu

SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved")


def boundary_bytes(micro_batch: int, seq_len: int, d_model: int) -> int:
    """Bytes of one micro-batch's activation between two Transformer stages in fp32."""
    return micro_batch * seq_len * d_model * 4


def multigpu_runs(args: argparse.Namespace, gpus: int) -> list[dict[str, Any]]:
    """The runs of the multigpu step: (name, ranks, --set items), K=2 throughout."""
    micro = args.micro_batch
    lm = ["model.arch=decoder-only", f"model.layers={args.layers}", f"model.d_model={args.d_model}",
          f"model.ff={args.ff}", f"model.heads={args.heads}", f"model.max_len={args.seq_len}",
          f"data.seq_len={args.seq_len}", f"data.batch_size={micro * args.microbatches}",
          f"data.synthetic_size={args.synthetic_size}", f"pipeline.microbatches={args.microbatches}",
          "model.dropout=0.0", "eval.every=1000000", "pipeline.balance=params"]  # balance: nothing to time
    runs = []
    for schedule in SCHEDULES:
        sets = [*lm, f"pipeline.schedule={schedule}"]
        if schedule == "interleaved":
            sets.append("pipeline.virtual_stages=2")
        runs.append({"name": f"lm-{schedule}", "ranks": 2, "schedule": schedule, "data_parallel": 1,
                     "message_bytes": boundary_bytes(micro, args.seq_len, args.d_model), "sets": sets})
    if gpus >= 4:
        runs.append({"name": "lm-gpipe-dp2", "ranks": 4, "schedule": "gpipe", "data_parallel": 2,
                     "message_bytes": boundary_bytes(micro, args.seq_len, args.d_model),
                     "sets": [*lm, "pipeline.schedule=gpipe", "pipeline.data_parallel=2",
                              f"data.batch_size={2 * micro * args.microbatches}"]})
    # The quick start's translation model (number words, generated), evaluated with greedy decoding.
    runs.append({"name": "translation-bleu", "ranks": 2, "schedule": "gpipe", "data_parallel": 1,
                 "message_bytes": None, "sets": [f"data.synthetic_size={args.translation_size}",
                                                 f"eval.every={args.steps}", "eval.batches=1"]})
    return runs


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts ranks in sessions of their own: a group kill misses them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a run that outlived its bound: SIGTERM to it and every process it started, then SIGKILL."""
    victims = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        victims = [p for p in victims if Path(f"/proc/{p}").exists()]
        if not victims:
            return


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_run(code: int | None, records: list[dict[str, Any]], steps: int, wants_bleu: bool) -> list[str]:
    """What is wrong with a finished run (nothing: it passed)."""
    problems = []
    if code is None:
        problems.append("ran past its time bound")
    elif code != 0:
        problems.append(f"exit code {code}")
    losses = [r.get("loss") for r in records if r.get("kind") == "train"]
    if len(losses) != steps:
        problems.append(f"{len(losses)} train records, expected {steps}")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses):
        problems.append(f"non-finite loss: {losses}")
    if wants_bleu:
        scores = [r.get("bleu") for r in records if r.get("kind") == "eval"]
        if not scores or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in scores):
            problems.append(f"no finite BLEU in the eval records: {scores}")
    return problems


def multigpu(args: argparse.Namespace) -> dict[str, Any]:
    """`gpipe train` under torchrun at K=2 on two GPUs (and K=2 x D=2 on four): every schedule, then a
    translation model evaluated with greedy decoding (BLEU)."""
    cuda = args.device == "cuda"
    visible = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
    gpus = args.gpus if args.gpus is not None else visible
    if cuda and gpus < 2:
        line = f"multigpu: needs two GPUs, this machine has {gpus}: skipped"
        print(line, flush=True)
        return {"skipped": line, "gpus": gpus}
    backend = args.backend or ("nccl" if cuda else "gloo")
    folder = Path(args.work_dir or tempfile.mkdtemp(prefix="gpipe-multigpu-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out: dict[str, Any] = {"gpus": gpus, "backend": backend, "device": "cuda" if cuda else "cpu", "steps": args.steps,
                           "model": {"arch": "decoder-only", "layers": args.layers, "d_model": args.d_model,
                                     "ff": args.ff, "heads": args.heads, "seq_len": args.seq_len,
                                     "micro_batch": args.micro_batch, "microbatches": args.microbatches,
                                     "precision": "fp32"},
                           "runs": []}
    deadline = time.monotonic() + args.budget_s if args.budget_s else math.inf
    for run in multigpu_runs(args, gpus):
        run_dir = folder / run["name"]
        sets = [*run.pop("sets"), "pipeline.partitions=2", f"train.steps={args.steps}", "train.log_every=1",
                f"train.device={'cuda' if cuda else 'cpu'}", f"pipeline.backend={backend}"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(run["ranks"]), "-m", "gpipe_cli.cli", "train", str(ROOT / "recipes/quickstart.yaml"),
                   "--output-dir", str(run_dir), "--plain"]
        for item in sets:
            command += ["--set", item]
        bound = min(args.run_timeout, deadline - time.monotonic())
        if bound < 5:
            out["runs"].append({**run, "passed": False, "seconds": 0.0, "problems": ["not run: no time left"]})
            continue
        print(f"== multigpu {run['name']}: {run['ranks']} ranks, bound {bound:.0f} s: {' '.join(command)}",
              flush=True)
        started = time.perf_counter()
        proc = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
        seconds = time.perf_counter() - started
        records = _records(run_dir)
        problems = check_run(code, records, args.steps, run["name"].startswith("translation"))
        losses = [r.get("loss") for r in records if r.get("kind") == "train"]
        bleu = [r.get("bleu") for r in records if r.get("kind") == "eval"]
        row = {**run, "exit_code": code, "seconds": seconds, "passed": not problems, "problems": problems,
               "losses": losses, "samples_per_s": [r.get("samples_per_s") for r in records if r.get("kind") == "train"]}
        if any(b is not None for b in bleu):
            row["bleu"] = bleu[-1]
        out["runs"].append(row)
        keep(args.json, {**out, "partial": True})
        print(f"== multigpu {run['name']}: {'passed' if not problems else 'FAILED: ' + '; '.join(problems)} "
              f"({seconds:.1f} s)", flush=True)
    compare_schedules(out["runs"])
    out["passed"] = all(r["passed"] for r in out["runs"])
    return out


# The schedules compute the same gradients on the same data from the same weights: only the order of
# sums differs (and kernels that are not bitwise reproducible), ~1e-6 a step, far below this.
SAME_TRAINING = 1e-3


def compare_schedules(runs: list[dict[str, Any]]) -> None:
    """Every K=2 D=1 language-model run trains as GPipe's did, loss for loss (a problem otherwise)."""
    reference = next((r for r in runs if r["name"] == "lm-gpipe" and r["passed"]), None)
    if reference is None:
        return
    for run in runs:
        if run is reference or not run["name"].startswith("lm-") or run["data_parallel"] != 1 or not run["passed"]:
            continue
        gaps = [abs(a - b) / max(abs(b), 1.0) for a, b in zip(run["losses"], reference["losses"])]
        run["loss_gap_vs_gpipe"] = max(gaps, default=0.0)
        if run["loss_gap_vs_gpipe"] > SAME_TRAINING:
            run["passed"] = False
            run["problems"].append(f"losses {run['losses']} differ from gpipe's {reference['losses']} "
                                   f"(relative gap {run['loss_gap_vs_gpipe']:.1e} > {SAME_TRAINING:.0e})")


# --------------------------------------------------------------------------------------------- main

def parser() -> argparse.ArgumentParser:
    """The command line of every subcommand."""
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    o = sub.add_parser("overhead", help="engine at K=1 against a plain loop, per precision, batch, M, checkpoint")
    for flag, default in (("layers", 4), ("d-model", 1024), ("ff", 4096), ("heads", 16), ("seq-len", 512),
                          ("vocab-size", 8192), ("steps", 2), ("warmup", 1), ("rounds", 3), ("seed", 0),
                          ("sync-batch", 32), ("sync-microbatches", 4)):
        o.add_argument(f"--{flag}", type=int, default=default)
    o.add_argument("--batches", default="8,32,128", help="batch sizes, comma-separated")
    o.add_argument("--microbatches", default="1,4,16", help="M values, comma-separated (M > batch is skipped)")
    o.add_argument("--precisions", default="bf16,fp32", help="bf16 (autocast) and/or fp32")
    o.add_argument("--checkpoint", default="never,except_last", help="checkpoint modes for M > 1")
    o.add_argument("--round-s", type=float, default=0.25,
                   help="run at least this many seconds of steps per round (short steps: more of them, up to 50)")
    o.add_argument("--budget-s", type=float, default=0.0,
                   help="stop starting new configurations after this many seconds (0: no limit)")
    f = sub.add_parser("fits", help="train the largest models of a profile-memory --budget JSON file")
    f.add_argument("--table", required=True, help="the JSON file of gpipe profile-memory --budget")
    f.add_argument("--extra", action="store_true",
                   help="also V-Half (virtual stages 2) and offload rows, and the goals (Transformer-L)")
    m = sub.add_parser("messages", help="seconds per message between two ranks sharing the GPU")
    m.add_argument("--sizes", default="65536,1048576,4194304,16777216", help="message sizes in bytes")
    m.add_argument("--count", type=int, default=50)
    g = sub.add_parser("multigpu", help="gpipe train at K=2 on two GPUs (NCCL): schedules, D=2, BLEU")
    for flag, default in (("layers", 4), ("d-model", 1024), ("ff", 4096), ("heads", 16), ("seq-len", 512),
                          ("micro-batch", 8), ("microbatches", 4), ("steps", 4), ("synthetic-size", 256),
                          ("translation-size", 1024)):
        g.add_argument(f"--{flag}", type=int, default=default)
    g.add_argument("--gpus", type=int, default=None, help="GPUs to plan for [default: those visible]")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default=None,
                   help="pipeline.backend [default: nccl on CUDA, gloo on the CPU]")
    g.add_argument("--run-timeout", type=float, default=60.0, help="seconds each run may take")
    g.add_argument("--budget-s", type=float, default=0.0, help="seconds all runs may take (0: no limit)")
    g.add_argument("--work-dir", default=None, help="where the runs write [default: a new temporary folder]")
    for p in (o, f, m, g):
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                       help="cuda (default), or cpu to check the measurement without a GPU")
        p.add_argument("--json", required=True, type=Path)
    return top


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand, measure, write the JSON file; non-zero when a multigpu run failed."""
    args = parser().parse_args(argv)
    figures = {"overhead": overhead, "fits": fits, "messages": messages, "multigpu": multigpu}[args.command](args)
    figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    keep(args.json, figures)
    print(f"gpu_measure {args.command}: figures written to {args.json}")
    return 1 if figures.get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())
