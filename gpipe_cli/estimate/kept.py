"""A model's shapes-only figures (per-layer FLOPs and bytes), kept beside the layer costs for the next launch."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate.cost_cache import cache_path, unwritable
from gpipe_cli.files import atomic_write_bytes
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.describe import LayerCost, ModelSummary, describe

T = TypeVar("T")


@functools.cache
def code_digest() -> str:
    """A digest of this package's source: figures another version of the code worked out are not reused."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def _kept(key: dict[str, Any] | None, work: Callable[[], T], to_json: Callable[[T], Any] = lambda found: found,
          from_json: Callable[[Any], T] = lambda data: data) -> T:
    """`work()`'s result, from the cache when an earlier launch kept it under `key`, else worked out and kept."""
    # Tracing a model on the meta device takes seconds, and so does importing torch's compiler, which its Python
    # meta kernels and optimizers load first: every launch of a command did both again for the same model, in the
    # launcher's check and then in each rank's plan.
    if key is None:  # a model built by hand: nothing names it
        return work()
    key = {**key, "torch": torch.__version__, "code": code_digest()}
    path = _named(cache_path(key))
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none kept yet, or a damaged file
        data = json.loads(path.read_text())
        if data["key"] == key:
            return from_json(data["figures"])
    found = work()
    if unwritable(path.parent) is None:
        with contextlib.suppress(OSError):  # a folder that turned unwritable since the probe costs only the reuse
            atomic_write_bytes(path, json.dumps({"key": key, "figures": to_json(found)}).encode())
        _prune(path.parent)
    return found


PREFIX = "kept-"


def _ours() -> str:
    """How the names of the files this version of the code keeps begin."""
    return f"{PREFIX}{code_digest()[:12]}-"


def _named(path: Path) -> Path:
    """The file of figures kept under the digest `path` is named by, its name led by this code's version."""
    return path.with_name(_ours() + path.name)


def _prune(folder: Path) -> None:
    """Delete the figures that other versions of the code kept: none of them is read again."""
    # Two versions of the package used in turn delete each other's files: each works its figures out again.
    for old in folder.glob(f"{PREFIX}*.json"):
        if not old.name.startswith(_ours()):
            with contextlib.suppress(OSError):  # gone already, or another user's
                old.unlink()


def _model(spec: ModelSpec, what: dict[str, Any]) -> dict[str, Any] | None:
    """The key of figures of `spec` (None for a model built by hand, which nothing names)."""
    return {"kind": "shapes", **what, "model": spec.config, "layers": len(spec.layers)} if spec.config else None


def summary(spec: ModelSpec, batch_size: int) -> ModelSummary:
    """`describe(spec, batch_size)`: parameters, forward FLOPs and output bytes of every layer."""
    key = _model(spec, {"what": "summary", "batch_size": batch_size})
    return _kept(key, lambda: describe(spec, batch_size), asdict, _summary)


def figures(spec: ModelSpec, batches: Sequence[int] = mm.PROBE_BATCHES) -> mm.ModelFigures:
    """`memory_model.measure` on the meta device: every layer's parameters and bytes, from shapes alone."""
    # On the meta device no value is drawn, so the seed changes nothing.
    key = _model(spec, {"what": "figures", "batches": list(batches)})
    return _kept(key, functools.partial(mm.measure, spec, batches=batches, device="meta"), _figures_json, _figures)


@functools.lru_cache(maxsize=32)  # bench's sizing asks it of every candidate
def bytes_per_parameter(optimizer: str) -> float:
    """`memory_model.bytes_per_parameter`: weight, gradient and `optimizer`'s state bytes per parameter."""
    return _kept({"kind": "optimizer state", "optimizer": optimizer},
                 functools.partial(mm.bytes_per_parameter, optimizer))


def _summary(data: dict[str, Any]) -> ModelSummary:
    layers = tuple(LayerCost(**{**layer, "output_shapes": tuple(map(tuple, layer["output_shapes"]))})
                   for layer in data["layers"])
    return ModelSummary(**{**data, "layers": layers})


def _figures_json(found: mm.ModelFigures) -> dict[str, Any]:
    return {"input": asdict(found.input), "layers": [asdict(layer) for layer in found.layers], "ties": found.ties}


def _figures(data: dict[str, Any]) -> mm.ModelFigures:
    layers = tuple(mm.LayerFigures(layer["name"], layer["params"], mm.Affine(**layer["saved"]),
                                   mm.Affine(**layer["output"]), mm.Affine(**layer["saved_input"]))
                   for layer in data["layers"])
    ties = tuple((tuple(members), numel) for members, numel in data["ties"])
    return mm.ModelFigures(mm.Affine(**data["input"]), layers, ties)
