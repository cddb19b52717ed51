"""Collect the GPU acceptance's results into OUT_DIR/figures.json.

Usage: python scripts/gpu_figures.py OUT_DIR [--raw DIR] [--merge-only]

    --raw DIR      first merge every DIR/*.json (the steps' own JSON files, by file name without
                   .json) into OUT_DIR/raw.json, keeping what an earlier run of other steps put there
    --merge-only   merge and stop (no figures.json; quick, imports no torch)

figures.json is built from OUT_DIR/raw.json, OUT_DIR/junit.xml (pytest) and OUT_DIR/steps.jsonl (each
step's status, seconds and time bound, as scripts/gpu-acceptance.sh records them). Every figure keeps
the raw entry it came from; a measurement that did not run is listed under "missing".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# The paper's Table 1: parameters of the largest model with rematerialization (pipeline-1) over
# without (naive-1), on one device (AmoebaNet-D 82M -> 318M, Transformer-L 282.2M -> 785.8M).
PAPER_REMAT_GAIN = {"amoebanet": 3.9, "transformer": 2.7}
RAW = "raw.json"
STEPS = "steps.jsonl"
JUNIT = "junit.xml"
FIGURES = "figures.json"
LOG = "acceptance.log"
# Every file an acceptance run leaves in OUT_DIR: at most 8.
OUTPUTS = (LOG, JUNIT, STEPS, RAW, FIGURES)


def merge(out_dir: Path, raw_dir: Path) -> dict[str, Any]:
    """OUT_DIR/raw.json updated with every raw_dir/*.json (an unreadable file is kept as its error)."""
    target = out_dir / RAW
    raw: dict[str, Any] = json.loads(target.read_text()) if target.exists() else {}
    for path in sorted(raw_dir.glob("*.json")):
        try:
            raw[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raw[path.stem] = {"unreadable": f"{path.name}: {exc}"}
    tmp = target.with_name(f".{target.name}.{os.getpid()}")  # the multigpu step merges beside the others
    tmp.write_text(json.dumps(raw, indent=1))
    tmp.replace(target)
    return raw


def tests(junit: Path) -> dict[str, Any] | None:
    """Counts of the pytest run's JUnit XML."""
    if not junit.exists():
        return None
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as exc:
        return {"unreadable": str(exc), "source": junit.name}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    seconds = sum(float(s.get("time", 0) or 0) for s in suites)
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed, "seconds": seconds, "source": junit.name}


def overhead(raw: dict[str, Any]) -> dict[str, Any]:
    """The engine at K=1 against the hand-written loop: one row per (precision, batch, M, checkpoint)."""
    keys = ("precision", "batch_size", "microbatches", "checkpoint", "engine_samples_per_s", "plain_samples_per_s",
            "ratio", "loss_gap", "goal", "meets_goal")
    rows = [{k: r.get(k) for k in keys} for r in raw.get("rows", [])]
    judged = [r for r in rows if r["goal"] is not None]
    return {"model": raw["model"]["name"], "device": raw.get("device"), "fp32_matmul": raw.get("fp32_matmul"),
            "method": raw.get("method"), "goals": raw.get("goals"), "rows": rows,
            "meets_goals": all(r["meets_goal"] for r in judged) if judged else None,
            "not_measured": raw.get("not_measured", []), "source": f"{RAW}: overhead"}


def sync_debug(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Synchronisations per training step (the warm-up step excluded), engine and plain loop."""
    keys = ("side", "precision", "batch_size", "microbatches", "checkpoint", "per_step", "where", "mode")
    return [{k: r.get(k) for k in keys} for r in raw.get("sync_debug", [])]


def table1(raw: dict[str, Any], fits: dict[str, Any] | None, source: str) -> dict[str, Any]:
    """The largest models with and without rematerialization, and whether each trained on the GPU."""
    rows = {r["scenario"]: r for r in raw["rows"] if r is not None}
    out: dict[str, Any] = {"family": raw["family"], "budget_bytes": raw["budget_bytes"],
                           "batch_size": raw["batch_size"], "optimizer": raw["optimizer"], "method": raw["method"],
                           "source": source}
    for name in ("naive-1", "pipeline-1"):
        row = rows.get(name)
        out[name] = None if row is None else {"model": row["model"], "params": row["params"],
                                              "device_peak_bytes": row["device_peak_bytes"]}
    if rows.get("naive-1") and rows.get("pipeline-1"):
        gain = rows["pipeline-1"]["params"] / rows["naive-1"]["params"]
        out["remat_params_gain"] = gain
        out["paper_gain"] = PAPER_REMAT_GAIN[raw["kind"]]
        out["meets_paper"] = gain >= PAPER_REMAT_GAIN[raw["kind"]]
    out["correction"] = raw.get("correction")  # what the device probe added to the accounting (None: not run)
    if fits is not None:
        # Every row trained on the GPU, V-Half and offload among them: its predicted against its measured peak.
        out["on_gpu"] = {r["scenario"]: {k: r.get(k) for k in (
            "model", "params", "schedule", "offload", "trained", "predicted_bytes", "measured_bytes", "ratio",
            "peak_bytes", "within_budget", "error", "seconds")} for r in fits["rows"]}
        if "checks" in fits:
            out["checks"] = fits["checks"]
    return out


def bench(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Throughput per K with ranks sharing the GPU (K=1 from the first run's own K=1 measurement)."""
    out: dict[str, Any] = {}
    for k in sorted(runs):
        raw = runs[k]
        if not out:
            out["K=1"] = {"samples_per_s": raw["samples_per_s_k1"], "tokens_per_s": raw.get("tokens_per_s_k1"),
                          "source": f"{RAW}: bench-k{k}"}
        out[f"K={k}"] = {key: raw.get(key) for key in ("samples_per_s", "tokens_per_s", "normalized", "ideal",
                                                        "efficiency", "bubble", "bubble_theory", "microbatches",
                                                        "batch_size", "oversubscribed")}
        out[f"K={k}"]["source"] = f"{RAW}: bench-k{k}"
    return out


def multigpu(raw: dict[str, Any]) -> dict[str, Any]:
    """Per run: passed, seconds, ranks, schedule, message size, last loss (and BLEU)."""
    if "skipped" in raw:
        return {"skipped": raw["skipped"], "gpus": raw.get("gpus")}
    runs = {}
    for r in raw.get("runs", []):
        losses = r.get("losses") or []
        runs[r["name"]] = {"passed": r["passed"], "seconds": r.get("seconds"), "ranks": r.get("ranks"),
                           "schedule": r.get("schedule"), "data_parallel": r.get("data_parallel"),
                           "message_bytes": r.get("message_bytes"), "last_loss": losses[-1] if losses else None,
                           "loss_gap_vs_gpipe": r.get("loss_gap_vs_gpipe"), "problems": r.get("problems", [])}
        if r.get("bleu") is not None:
            runs[r["name"]]["bleu"] = r["bleu"]
    return {"gpus": raw.get("gpus"), "backend": raw.get("backend"), "model": raw.get("model"),
            "passed": raw.get("passed"), "runs": runs, "source": f"{RAW}: multigpu"}


def steps(path: Path) -> list[dict[str, Any]]:
    """Each step's record (status, exit code, seconds, time bound and estimate), in the order run."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"unreadable": line[:200]})
    return out


def environment() -> dict[str, Any]:
    """The machine the figures were taken on."""
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "python": platform.python_version(), "cpus": os.cpu_count(),
                           "bound_scale": os.environ.get("GPU_ACCEPTANCE_BOUND_SCALE", "1")}
    try:  # which code measured: the figures of another version are not comparable
        from gpipe_cli import __version__
        from gpipe_cli.estimate.kept import code_digest

        out.update(gpipe_cli=__version__, code_digest=code_digest())
    except ImportError:
        pass
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, gpus=torch.cuda.device_count(),
                       gpu_free_bytes=torch.cuda.mem_get_info(0)[0])
    except ImportError:
        pass
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=3)
        if driver.returncode == 0 and driver.stdout.strip():
            out["driver"] = driver.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def collect(out_dir: Path) -> dict[str, Any]:
    """Every figure found under `out_dir`."""
    raw: dict[str, Any] = json.loads((out_dir / RAW).read_text()) if (out_dir / RAW).exists() else {}
    records = steps(out_dir / STEPS)
    figures: dict[str, Any] = {"environment": environment(), "steps": records, "missing": []}
    skipped = {r["step"]: r.get("why", "skipped") for r in records if r.get("status") == "skipped"}

    def need(name: str) -> dict[str, Any] | None:
        data = raw.get(name)
        if data is None and name in skipped:  # a step the machine cannot run: not missing
            return None
        if data is None or "unreadable" in data:
            figures["missing"].append(f"{RAW}: {name}" + (f" ({data['unreadable']})" if data else ""))
            return None
        if data.get("partial"):  # its rows so far, kept as measured: the step ended before the rest
            figures["missing"].append(f"{RAW}: {name} (partial: the step ended before it was done)")
        return data

    figures["tests"] = tests(out_dir / JUNIT)
    if figures["tests"] is None:
        figures["missing"].append(JUNIT)
    if (data := need("overhead")) is not None:
        figures["engine_overhead"] = overhead(data)
        figures["sync_debug"] = sync_debug(data)
        figures["host_profile"] = data.get("host_profile", [])
    figures["table1"] = {}
    for kind in ("amoebanet", "transformer"):
        if (data := need(f"table1-{kind}")) is not None:
            figures["table1"][kind] = table1(data, need(f"fits-{kind}"), f"{RAW}: table1-{kind}")
    # bench runs only when named: its figures are missing only from a run that recorded it.
    benched = sorted(r["step"] for r in records if str(r.get("step", "")).startswith("bench-k"))
    found = {int(name[len("bench-k"):]): data for name in benched if (data := need(name)) is not None}
    figures["bench"] = bench(found) if found else {}
    if (data := need("messages")) is not None:
        figures["host_memory_messages"] = data
    if (data := need("multigpu")) is not None:
        figures["multigpu"] = multigpu(data)
    elif "multigpu" in skipped:
        figures["multigpu"] = {"skipped": skipped["multigpu"]}
    return figures


def main(argv: list[str]) -> int:
    """Merge the raw files when asked, then write OUT_DIR/figures.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--raw", type=Path, default=None, help="a folder of the steps' JSON files to merge first")
    parser.add_argument("--merge-only", action="store_true", help="merge into raw.json and stop")
    args = parser.parse_args(argv)
    if args.raw is not None:
        merge(args.out_dir, args.raw)
    if args.merge_only:
        return 0
    figures = collect(args.out_dir)
    target = args.out_dir / FIGURES
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(json.dumps(figures, indent=2))
    partial.replace(target)
    print(f"gpu_figures: {target} ({len(figures['missing'])} measurement(s) missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
