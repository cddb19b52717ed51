"""Measurements of the GPU acceptance that no `gpipe` command makes; each writes its figures as JSON.

    overhead   samples/s of the engine at K=1 against a plain PyTorch loop over the same layers,
               same batch, bf16 autocast, timed by the same clock as `gpipe bench`
    fits       train one step of each largest model `gpipe profile-memory --budget` found, on the
               GPU, and read the CUDA allocator's peak (or the out-of-memory error)
    messages   seconds per message between two ranks sharing one GPU (device -> host -> gloo ->
               host -> device) against the same messages between two CPU ranks

Usage: python scripts/gpu_measure.py {overhead,fits,messages} [options] --json FILE
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gpipe_cli.estimate.measure import measure_engine, timed
from gpipe_cli.estimate.subject import example_batch, resolve
from gpipe_cli.models.registry import build_model
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.comm import FORWARD, Inbound, Outbound, Transport
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.profile.account import OPTIMIZERS


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_measure: no CUDA GPU is visible")
    return torch.device("cuda", 0)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return tuple(_to(b, device) for b in batch)


# ----------------------------------------------------------------------------------------- overhead

def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """The engine (K=1, M=1, no rematerialization) against a plain loop, both in bf16 autocast."""
    device = _cuda()
    sizes = {"layers": args.layers, "d_model": args.d_model, "ff": args.ff, "heads": args.heads,
             "vocab_size": args.vocab_size, "seq_len": args.seq_len}
    # Dropout 0: outside the engine dropout is torch's; inside, masks are drawn per example.
    subject = resolve("transformer", sizes, ["arch=decoder-only", "dropout=0"])
    spec = subject.build()
    inputs, targets = example_batch(spec, args.batch_size, args.seed)
    n = len(spec.layers)

    pipe = Pipeline(build_layers(spec.factories(), range(n), args.seed, device), topology.local(device), [n],
                    spec.loss, units=spec.units, checkpoint="never", precision="bf16")
    plain = nn.Sequential(*build_layers(spec.factories(), range(n), args.seed, device)).train()

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = spec.loss(plain(_to(inputs, device)), targets.to(device, non_blocking=True))
        loss.backward()
        torch.cuda.synchronize(device)

    engine_times: list[float] = []
    plain_times: list[float] = []
    for _ in range(args.rounds):  # interleaved, so that clock and thermal drift hit both alike
        figures = measure_engine(pipe, inputs, targets, args.batch_size, 1, args.steps, args.warmup)
        assert figures is not None
        engine_times += figures.step_times
        for index in range(args.warmup + args.steps):
            seconds, _ = timed(plain_step)
            if index >= args.warmup:
                plain_times.append(seconds)
    engine = args.batch_size / statistics.median(engine_times)
    baseline = args.batch_size / statistics.median(plain_times)
    return {"model": {**subject.to_json(), "name": spec.name, "layers": n}, "batch_size": args.batch_size,
            "precision": "bf16", "microbatches": 1, "checkpoint": "never", "steps": args.steps * args.rounds,
            "engine_samples_per_s": engine, "plain_samples_per_s": baseline, "ratio": engine / baseline,
            "goal": 0.97, "engine_step_times": engine_times, "plain_step_times": plain_times}


# --------------------------------------------------------------------------------------------- fits

def _model_of(kind: str, label: str, fixed: dict[str, Any]) -> Any:
    """The family member a `--budget` row names: "(L, D)" for AmoebaNet-D, "L" for Transformer-L."""
    if kind == "amoebanet":
        match = re.fullmatch(r"\((\d+), (\d+)\)", label)
        if match is None:
            raise SystemExit(f"gpu_measure: cannot read the AmoebaNet-D size '{label}'")
        return build_model("amoebanet", layers=int(match.group(1)), filters=int(match.group(2)), **fixed)
    return build_model("transformer", layers=int(label), **fixed)


def _one_step(spec: Any, batch: int, microbatches: int, checkpoint: str, optimizer: str,
              device: torch.device) -> dict[str, Any]:
    """One training step and optimizer step at K=1; the allocator's peak, or the error."""
    n = len(spec.layers)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        pipe = Pipeline(build_layers(spec.factories(), range(n), 0, device), topology.local(device), [n], spec.loss,
                        units=spec.units, checkpoint=checkpoint)
        opt = OPTIMIZERS[optimizer](pipe.parameters())
        inputs, targets = example_batch(spec, batch, 0)
        pipe.train_step(inputs, targets, microbatches=microbatches, step=0)
        opt.step()
        torch.cuda.synchronize(device)
        result: dict[str, Any] = {"trained": True}
    except RuntimeError as exc:  # the allocator's OutOfMemoryError, or cuBLAS/cuDNN failing to allocate
        if "out of memory" not in str(exc).lower():
            raise
        result = {"trained": False, "error": str(exc).splitlines()[0]}
    result.update(peak_bytes=int(torch.cuda.max_memory_allocated(device)), seconds=time.perf_counter() - started)
    pipe = opt = None  # type: ignore[assignment]
    gc.collect()
    torch.cuda.empty_cache()
    return result


def fits(args: argparse.Namespace) -> dict[str, Any]:
    """Train every row of a `profile-memory --budget` JSON file on the GPU, as the row says."""
    device = _cuda()
    table = json.loads(Path(args.table).read_text())
    rows = []
    for row in table["rows"]:
        if row is None or row["partitions"] != 1:
            continue
        spec = _model_of(table["kind"], row["model"], table["fixed"])
        print(f"gpu_measure: {row['scenario']}: {table['family']} {row['model']}, training one step...", flush=True)
        outcome = _one_step(spec, table["batch_size"], row["microbatches"], row["checkpoint"], table["optimizer"],
                            device)
        rows.append({**row, **outcome, "budget_bytes": table["budget_bytes"],
                     "within_budget": outcome["trained"] and outcome["peak_bytes"] <= table["budget_bytes"]})
    return {"family": table["family"], "kind": table["kind"], "batch_size": table["batch_size"],
            "optimizer": table["optimizer"], "device": torch.cuda.get_device_name(device),
            "method": "CUDA allocator peak (torch.cuda.max_memory_allocated) over one step and optimizer step",
            "rows": rows}


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
    transport = Transport(device, staging=device.type == "cuda")  # what ranks sharing a GPU use
    seconds = {}
    for size in sizes:
        payload = torch.randn(size // 4, device=device)
        channel: Outbound | Inbound = (Outbound(transport, 1, FORWARD) if rank == 0
                                       else Inbound(transport, 0, FORWARD, "activations"))
        for _ in ("warm-up", "measured"):  # the first step learns the buffer size, as training does
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
    """Seconds per message of each size, staged through host memory on one GPU and between CPU ranks."""
    _cuda()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for device_type in ("cuda", "cpu"):
            out = os.path.join(folder, f"{device_type}.json")
            mp.spawn(_message_rank, args=(_free_port(), device_type, sizes, args.count, out), nprocs=2, join=True)
            rows[device_type] = json.loads(Path(out).read_text())
    table = []
    for size in sizes:
        staged, host = rows["cuda"][str(size)], rows["cpu"][str(size)]
        table.append({"bytes": size, "gpu_shared_s": staged, "cpu_gloo_s": host, "staging_cost_s": staged - host,
                      "gpu_shared_gb_s": size / staged / 1e9})
    return {"count": args.count, "transport": "gloo through host memory (ranks sharing one GPU) vs gloo on CPU",
            "messages": table}


def main() -> None:
    """Parse the subcommand, measure, write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    o = sub.add_parser("overhead", help="engine at K=1 against a plain PyTorch loop, bf16")
    for flag, default in (("layers", 8), ("d-model", 1024), ("ff", 4096), ("heads", 16), ("seq-len", 512),
                          ("vocab-size", 8192), ("batch-size", 32), ("steps", 20), ("warmup", 5), ("rounds", 2),
                          ("seed", 0)):
        o.add_argument(f"--{flag}", type=int, default=default)
    f = sub.add_parser("fits", help="train the largest models of a profile-memory --budget JSON file")
    f.add_argument("--table", required=True, help="the JSON file of gpipe profile-memory --budget")
    m = sub.add_parser("messages", help="seconds per message between two ranks sharing the GPU")
    m.add_argument("--sizes", default="65536,1048576,4194304,16777216", help="message sizes in bytes")
    m.add_argument("--count", type=int, default=50)
    for p in (o, f, m):
        p.add_argument("--json", required=True, type=Path)
    args = parser.parse_args()
    figures = {"overhead": overhead, "fits": fits, "messages": messages}[args.command](args)
    figures["gpu"] = torch.cuda.get_device_name(0)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2))
    print(f"gpu_measure {args.command}: figures written to {args.json}")


if __name__ == "__main__":
    main()
