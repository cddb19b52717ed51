"""`gpipe profile-memory`: per-stage memory of naive-1, pipeline-1 and pipeline-K, or the largest model per K.

    naive-1      K=1, one micro-batch, no rematerialization (plain training)
    pipeline-1   K=1, M micro-batches, rematerialization
    pipeline-K   K stages, M micro-batches, rematerialization
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from rich.console import Console

from gpipe_cli.bench.subject import SIZE_PARAMS, example_batch, resolve
from gpipe_cli.errors import UserError
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import describe
from gpipe_cli.pipeline import microbatch, partition
from gpipe_cli.profile import account, budget, report
from gpipe_cli.profile.figures import layer_param_counts
from gpipe_cli.profile.options import ProfileOptions, validate
from gpipe_cli.units import human_bytes


def _device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _balance(options: ProfileOptions, spec: ModelSpec, k: int, batch: int) -> list[int]:
    layers = len(spec.layers)
    try:
        partition.check_partitions(layers, k)
        if options.balance:
            explicit = [int(p) for p in options.balance.split(",")]
            return partition.check_balance(explicit, layers, k)
        size = max(microbatch.sizes(batch, options.microbatches))
        flops = [float(c.flops) for c in describe(spec, size).layers]
        return partition.balance_by_cost(flops if any(flops) else [float(p) for p in layer_param_counts(spec)], k)
    except ValueError as exc:
        raise UserError(f"--partitions/--balance: {exc} (the model has {layers} layers)") from None


def _check_fits(spec: ModelSpec, options: ProfileOptions, device: torch.device) -> None:
    """Refuse, in one line, a model whose largest stage (K=1: all of it) cannot be built here."""
    need = sum(layer_param_counts(spec)) * budget.bytes_per_parameter(options.optimizer)
    have = _available_bytes(device)
    if need > have:
        raise UserError(f"the whole model needs {human_bytes(need)} for weights, gradients and optimizer "
                        f"state, but {human_bytes(have)} is free: shrink it (--layers, --d-model, "
                        f"--filters ...) or estimate larger models with --budget")


def measure(options: ProfileOptions, console: Console) -> dict[str, Any]:
    """Measure every scenario's stages; the figures as the JSON file holds them."""
    subject = resolve(options.model, options.sizes(), options.set)
    spec = subject.build()
    device = _device(options.device)
    _check_fits(spec, options, device)
    m = options.microbatches
    batch = options.batch_size or 4 * m
    inputs, targets = example_batch(spec, batch, options.seed)
    scenarios = [("naive-1", 1, 1, "never"), ("pipeline-1", 1, m, options.checkpoint)]
    scenarios += [(f"pipeline-{k}", k, m, options.checkpoint) for k in options.partitions if k > 1]
    out = []
    for name, k, chunks, checkpoint in scenarios:
        balance = _balance(options, spec, k, batch) if k > 1 else [len(spec.layers)]
        console.print(f"[dim]measuring {name} (balance {balance})...[/]")
        stages = account.measure(spec, inputs, targets, balance, chunks, options.schedule, checkpoint,
                                 options.optimizer, options.seed, device)
        out.append({"name": name, "partitions": k, "microbatches": chunks, "checkpoint": checkpoint,
                    "balance": balance, "stages": [s.to_json() for s in stages],
                    "device_peak_bytes": max(s.total_bytes for s in stages)})
    return {"model": {**subject.to_json(), "name": spec.name, "layers": len(spec.layers)}, "batch_size": batch,
            "microbatches": m, "schedule": options.schedule, "checkpoint": options.checkpoint,
            "optimizer": options.optimizer, "device": str(device), "method": account.method(device),
            "scenarios": out}


def _family(options: ProfileOptions) -> tuple[str, dict[str, Any]]:
    subject = resolve(options.model, {}, ())
    kind = subject.kind
    fixed = dict(budget.TRANSFORMER_L if kind == "transformer" else budget.AMOEBANET_D)
    for flag, value in options.sizes().items():
        if value is None:
            continue
        param = SIZE_PARAMS[flag]
        if param not in fixed:
            raise UserError(f"--{flag.replace('_', '-')} does not apply to the {kind} family of --budget")
        fixed[param] = value
    return kind, fixed


def search(options: ProfileOptions, console: Console) -> dict[str, Any]:
    """The largest model per scenario within the budget; the figures as the JSON file holds them."""
    limit = budget.parse_bytes(options.budget or "")
    kind, fixed = _family(options)
    batch = options.batch_size or budget.PAPER_BATCH[kind]
    console.print(f"[dim]measuring per-layer figures of small {kind} models...[/]")
    family: budget.TransformerL | budget.AmoebaNetD = (
        budget.TransformerL(fixed, options.seed) if kind == "transformer" else budget.AmoebaNetD(fixed, options.seed))
    m = options.microbatches
    scenarios = [("naive-1", 1, 1, "never"), ("pipeline-1", 1, m, options.checkpoint)]
    scenarios += [(f"pipeline-{k}", k, m, options.checkpoint) for k in options.partitions if k > 1]
    rows = budget.search(family, scenarios, limit, batch, options.schedule, options.optimizer)
    return {"budget_bytes": limit, "family": family.title, "kind": kind, "fixed": fixed, "batch_size": batch,
            "microbatches": m, "schedule": options.schedule, "checkpoint": options.checkpoint,
            "optimizer": options.optimizer, "bytes_per_param": budget.bytes_per_parameter(options.optimizer),
            "method": "per-layer figures measured by saved-tensor accounting on small members, scaled",
            "rows": [None if r is None else r.to_json() for r in rows],
            "scenarios": [s[0] for s in scenarios], "paper": budget.PAPER_TABLE1[kind]}


def run(options: ProfileOptions) -> int:
    """Run `gpipe profile-memory`; print the figures and return an exit code (UserError for bad options)."""
    console = Console()
    validate(options)
    if options.budget is not None:
        summary = search(options, console)
        report.show_budget(summary, console)
    else:
        summary = measure(options, console)
        report.show_measured(summary, console)
    if options.json is not None:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(summary, indent=2))
        console.print(f"[dim]figures written to {options.json}[/]")
    return 0
