"""Collect the GPU acceptance's JSON outputs (OUT_DIR/raw/*.json, OUT_DIR/junit.xml) into OUT_DIR/figures.json.

Usage: python scripts/gpu_figures.py OUT_DIR

Every figure keeps the file it came from; a measurement that did not run is listed under "missing".
"""

from __future__ import annotations

import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# The paper's Table 1: parameters of the largest model with rematerialization (pipeline-1) over
# without (naive-1), on one device (AmoebaNet-D 82M -> 318M, Transformer-L 282.2M -> 785.8M).
PAPER_REMAT_GAIN = {"amoebanet": 3.9, "transformer": 2.7}
OVERHEAD_GOAL = 0.97


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def tests(junit: Path) -> dict[str, Any] | None:
    """Counts of the pytest run's JUnit XML."""
    if not junit.exists():
        return None
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed, "source": str(junit)}


def overhead(raw: dict[str, Any], source: Path) -> dict[str, Any]:
    """Engine at K=1 against the plain loop."""
    keys = ("engine_samples_per_s", "plain_samples_per_s", "ratio", "batch_size", "precision", "steps")
    return {**{k: raw[k] for k in keys}, "model": raw["model"]["name"], "goal": OVERHEAD_GOAL,
            "meets_goal": raw["ratio"] >= OVERHEAD_GOAL, "source": str(source)}


def table1(raw: dict[str, Any], fits: dict[str, Any] | None, source: Path) -> dict[str, Any]:
    """The largest models with and without rematerialization, and whether each trained on the GPU."""
    rows = {r["scenario"]: r for r in raw["rows"] if r is not None}
    out: dict[str, Any] = {"family": raw["family"], "budget_bytes": raw["budget_bytes"],
                           "batch_size": raw["batch_size"], "optimizer": raw["optimizer"], "method": raw["method"],
                           "source": str(source)}
    for name in ("naive-1", "pipeline-1"):
        row = rows.get(name)
        out[name] = None if row is None else {"model": row["model"], "params": row["params"],
                                              "device_peak_bytes": row["device_peak_bytes"]}
    if rows.get("naive-1") and rows.get("pipeline-1"):
        gain = rows["pipeline-1"]["params"] / rows["naive-1"]["params"]
        out["remat_params_gain"] = gain
        out["paper_gain"] = PAPER_REMAT_GAIN[raw["kind"]]
        out["meets_paper"] = gain >= PAPER_REMAT_GAIN[raw["kind"]]
    if fits is not None:
        out["on_gpu"] = {r["scenario"]: {k: r.get(k) for k in ("trained", "peak_bytes", "within_budget", "error")}
                         for r in fits["rows"]}
    return out


def bench(runs: dict[int, dict[str, Any]], sources: dict[int, Path]) -> dict[str, Any]:
    """Throughput per K with ranks sharing the GPU (K=1 from the first run's own K=1 measurement)."""
    out: dict[str, Any] = {}
    for k in sorted(runs):
        raw = runs[k]
        if not out:
            out["K=1"] = {"samples_per_s": raw["samples_per_s_k1"], "tokens_per_s": raw.get("tokens_per_s_k1"),
                          "source": str(sources[k])}
        out[f"K={k}"] = {key: raw.get(key) for key in ("samples_per_s", "tokens_per_s", "normalized", "ideal",
                                                        "efficiency", "bubble", "bubble_theory", "microbatches",
                                                        "batch_size", "oversubscribed")}
        out[f"K={k}"]["source"] = str(sources[k])
    return out


def environment() -> dict[str, Any]:
    """The machine the figures were taken on."""
    out: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, gpus=torch.cuda.device_count())
    except ImportError:
        pass
    return out


def collect(out_dir: Path) -> dict[str, Any]:
    """Every figure found under `out_dir`."""
    raw_dir = out_dir / "raw"
    figures: dict[str, Any] = {"environment": environment(), "missing": []}

    def need(name: str) -> dict[str, Any] | None:
        data = _load(raw_dir / name)
        if data is None:
            figures["missing"].append(str(raw_dir / name))
        return data

    figures["tests"] = tests(out_dir / "junit.xml")
    if figures["tests"] is None:
        figures["missing"].append(str(out_dir / "junit.xml"))
    if (raw := need("overhead.json")) is not None:
        figures["engine_overhead"] = overhead(raw, raw_dir / "overhead.json")
    figures["table1"] = {}
    for kind in ("amoebanet", "transformer"):
        if (raw := need(f"table1-{kind}.json")) is not None:
            figures["table1"][kind] = table1(raw, need(f"fits-{kind}.json"), raw_dir / f"table1-{kind}.json")
    found = {k: data for k in (2, 4) if (data := need(f"bench-k{k}.json")) is not None}
    figures["bench"] = bench(found, {k: raw_dir / f"bench-k{k}.json" for k in found}) if found else {}
    if (raw := need("messages.json")) is not None:
        figures["host_memory_messages"] = raw
    return figures


def main(argv: list[str]) -> int:
    """Write OUT_DIR/figures.json."""
    if len(argv) != 1:
        print("usage: python scripts/gpu_figures.py OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    figures = collect(out_dir)
    target = out_dir / "figures.json"
    target.write_text(json.dumps(figures, indent=2))
    print(f"gpu_figures: {target} ({len(figures['missing'])} measurement(s) missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
