"""What a launch measures of this machine, cached: per-layer seconds for the cut, and a CPU's best matrix rate."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpipe_cli.errors import UserError, shown_path
from gpipe_cli.estimate import costs
from gpipe_cli.files import atomic_write_bytes, check_writable
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline.engine import PRECISIONS
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.units import human_bytes

CACHE_ENV = "GPIPE_CACHE_DIR"
FORMAT = 2      # bump when what is stored changes meaning (2: the recompute timed apart)
LEAST_FREE = 1 << 20  # bytes a folder must have free to be said to keep the costs
REPEATS = 3     # timed runs per layer and kind of compute (their median), after two untimed: a launch stays quick


@dataclass(frozen=True)
class Measured:
    """Per-layer costs of one micro-batch, and whether they came from the cache."""

    profile: costs.CostProfile
    cached: bool

    @property
    def label(self) -> str:
        """What the plan calls these costs."""
        return "measured time, cached" if self.cached else "measured time"


def cache_dir() -> Path:
    """Where measured costs are kept: $GPIPE_CACHE_DIR, else $XDG_CACHE_HOME/gpipe/layer-costs (~/.cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "gpipe" / "layer-costs"


def device_name(device: torch.device) -> str:
    """The device's model name (a GPU's name, a CPU's model from /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cache_key(recipe: Recipe, microbatch_size: int, device: torch.device) -> dict[str, Any]:
    """Everything the measured seconds depend on."""
    key: dict[str, Any] = {
        "format": FORMAT, "model": recipe.model.model_dump(mode="json"), "microbatch_size": microbatch_size,
        "precision": recipe.train.precision, "device": device.type, "device_name": device_name(device),
        "torch": torch.__version__,
    }
    if device.type == "cpu":  # a CPU rank's speed depends on how many threads it computes with
        key["threads"] = torch.get_num_threads()
    return key


def cache_path(key: dict[str, Any]) -> Path:
    """The cache file for a key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{digest}.json"


def unwritable(folder: Path) -> str | None:
    """Why measured costs cannot be kept in `folder`: "FOLDER cannot be written: WHY" (None: they can)."""
    try:  # probes without leaving anything behind, so a run that says "cached" keeps its word
        check_writable(folder, f"{shown_path(str(folder))} cannot be written")
        existing = next(p for p in (folder, *folder.parents) if p.exists())  # the probe makes no folder
        free = shutil.disk_usage(existing).free
    except UserError as exc:
        return str(exc)
    except OSError as exc:
        return f"{shown_path(str(folder))} cannot be read ({exc.strerror or exc})"
    # A full disk still makes the probe's empty file; the costs' file, some kilobytes, would not fit.
    return f"{shown_path(str(folder))} has {human_bytes(free)} free" if free < LEAST_FREE else None


def measure(spec: ModelSpec, recipe: Recipe, microbatch_size: int, device: torch.device,
            repeats: int = REPEATS) -> costs.CostProfile:
    """Time every layer of the recipe's model on one micro-batch on `device`, in the run's precision."""
    dtype = PRECISIONS[recipe.train.precision]
    # Measuring draws random inputs and builds layers: the run's own random streams stay untouched.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(recipe.seed)
        inputs, targets = spec.example_batch(microbatch_size, device)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            return costs.profile(spec, inputs, targets, recipe.seed, repeats, device)


def measured_costs(spec: ModelSpec, recipe: Recipe, microbatch_size: int, device: torch.device,
                   measuring: Callable[[str], None] = lambda note: None) -> Measured:
    """The recipe's per-layer costs on `device`: from the cache, or measured now and cached where it can be."""
    # `measuring` is told before a measurement whether its result will be kept ("cached for next time", or "not
    # cached: WHY"), decided by a probe of the folder, so that the line saying so is true.
    key = cache_key(recipe, microbatch_size, device)
    path = cache_path(key)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none cached, or a damaged file
        data = json.loads(path.read_text())
        found = costs.CostProfile.from_json(data["costs"])
        # A file for another key under this name, or of another number of layers: measure again.
        if data["key"] == key and found.layers and len(found.layers) == len(spec.layers):
            return Measured(found, cached=True)
    why = unwritable(path.parent)
    measuring("cached for next time" if why is None else f"not cached: {why}")
    profile = measure(spec, recipe, microbatch_size, device)
    if why is not None:  # already said; a write would only fail
        return Measured(profile, cached=False)
    with contextlib.suppress(OSError):  # a folder that turned unwritable since the probe only costs a measurement
        atomic_write_bytes(path, json.dumps({"key": key, "costs": asdict(profile)}).encode())
    return Measured(profile, cached=False)


def best_rate(measured: float, threads: int) -> float:
    """This CPU's fastest matrix-product rate at `threads`: `measured` now, or the best kept from earlier runs."""
    # A measurement on cores other processes keep busy comes out low (a tenth, seen), and MFU against it above 100%:
    # the best one seen on this machine stands for its peak, and is kept where the layer costs are.
    key = {"format": FORMAT, "kind": "cpu matrix-product peak", "device_name": device_name(torch.device("cpu")),
           "threads": threads, "torch": torch.__version__}
    path = cache_path(key)
    kept = 0.0
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none kept yet, or a damaged file
        data = json.loads(path.read_text())
        kept = float(data["flop_per_s"]) if data["key"] == key else 0.0
    if measured > kept and unwritable(path.parent) is None:
        with contextlib.suppress(OSError):
            atomic_write_bytes(path, json.dumps({"key": key, "flop_per_s": measured}).encode())
    return max(measured, kept)
