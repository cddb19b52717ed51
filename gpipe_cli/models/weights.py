"""A model's weights as one self-describing file: how to build it, which names share a tensor, its tokenizer."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.families import Task

MARK = "gpipe_export"  # its presence marks a gpipe export; its value is the format's version
VERSION = "1"
NO_TOKENIZER = "no_tokenizer"  # of a text model exported without its tokenizer: why it was left out
NO_TOKENIZER_FIX = "no_tokenizer_fix"  # and what would make an export with it
CLASSES = "classes"  # of an image model trained on named classes: their names in label order (JSON)
# How tensors are named, in every file gpipe export writes: also in one of weights only, which has no MARK.
LAYERS = "global layer index . parameter name"
_MAX_HEADER = 100_000_000  # safetensors refuses a longer header: such a length is no header at all


class WeightsOnly(ValueError):
    """A file gpipe export wrote with the weights alone: its run had no recipe.yaml to say which model they are."""


class NewerFormat(ValueError):
    """An export in a format a later gpipe-cli writes."""


def cut_short(path: Path) -> str | None:
    """What a safetensors file that ends too soon is, in words ("is empty", "is incomplete: ..."); None: it does not."""
    # The layout: 8 bytes of header length n, n bytes of JSON header, then the data its offsets span.
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = f.read(min(length, _MAX_HEADER))
    except OSError:  # gone or unreadable since: the caller's own reason stands
        return None
    if size == 0:
        return "is empty (0 bytes)"
    if size < 8 or not 2 <= length <= _MAX_HEADER or header[:1] not in (b"{", b""):
        return None  # its first bytes are no safetensors header: not a file of this kind at all
    if size < 8 + length:
        return f"is incomplete: it ends after {size:,} bytes, inside its header, which alone is {8 + length:,} bytes"
    try:
        entries = json.loads(header)
        end = max((int(e["data_offsets"][1]) for k, e in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if size < 8 + length + end:
        return f"is incomplete: it ends after {size:,} bytes, where its header says {8 + length + end:,}"
    return None


def store_once(tensors: dict[str, torch.Tensor],
               tied: list[tuple[str, ...]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors with each tied group kept under its first name only, and the tie map alias -> that name."""
    kept, aliases = dict(tensors), {}
    for first, *others in tied:
        for alias in others:
            if alias in kept and first in kept:
                if not torch.equal(kept[alias], kept[first]):  # one parameter in training: a copy that drifted
                    raise ValueError(f"tied tensors {alias} and {first} differ")
                del kept[alias]
                aliases[alias] = first
    return kept, aliases


def misfit(spec: ModelSpec, state: dict[str, torch.Tensor]) -> str | None:
    """Why `state` cannot be `spec`'s weights (a name it lacks or a shape it differs in); None: they fit."""
    with torch.device("meta"):  # shapes only: no memory for a model of any size
        expected = {k: tuple(v.shape) for k, v in nn.Sequential(*spec.build_all()).state_dict().items()}
    unknown = [k for k in state if k not in expected]
    if unknown:
        return f"{len(unknown)} tensor(s) the model has no place for, e.g. {unknown[0]}"
    for key, tensor in state.items():
        if tuple(tensor.shape) != expected[key]:
            return f"{key} has shape {tuple(tensor.shape)} where the model has {expected[key]}"
    return None


def not_finite(state: dict[str, torch.Tensor]) -> str | None:
    """Which weights hold NaN or infinity, in words (the first such tensor, how many in all); None: none do."""
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in state.items():  # a tied tensor once, under its first name
        unique.setdefault(id(tensor), (name, tensor))
    bad = [(name, t) for name, t in unique.values() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if not bad:
        return None
    name, tensor = bad[0]
    nan, inf = bool(tensor.isnan().any()), bool(tensor.isinf().any())
    count = int((~torch.isfinite(tensor)).sum())
    what = "NaN or infinite" if nan and inf else "NaN" if nan else "infinite"
    more = f"; {len(bad)} of the {len(unique)} tensors hold such values" if len(bad) > 1 else ""
    return f"{name}: {count:,} of its {tensor.numel():,} values {'is' if count == 1 else 'are'} {what}{more}"


def describe(spec: ModelSpec, aliases: dict[str, str], *, dtype: str, step: int, recipe: str | None,
             tokenizer: bytes | None, no_tokenizer: str | None = None, no_tokenizer_fix: str | None = None,
             classes: list[str] | None = None) -> dict[str, str]:
    """The metadata of an export of `spec`: model, tie map, dtype, the recipe and tokenizer (or why none)."""
    # safetensors allows only strings as metadata values, so structured ones are JSON.
    meta = {"format": "pt", MARK: VERSION, "step": str(step), "task": spec.task,
            "model": json.dumps(spec.config), "tied": json.dumps(aliases), "dtype": dtype,
            "layers": LAYERS}
    if recipe is not None:
        meta["recipe"] = recipe
    if tokenizer is not None:
        meta["tokenizer"] = base64.b64encode(tokenizer).decode("ascii")  # the sentencepiece model file's bytes
    elif no_tokenizer is not None:  # so that gpipe predict can say why it cannot run the file
        meta[NO_TOKENIZER] = no_tokenizer
        if no_tokenizer_fix is not None:
            meta[NO_TOKENIZER_FIX] = no_tokenizer_fix
    if classes:
        meta[CLASSES] = json.dumps(classes)
    return meta


def class_names(metadata: dict[str, str]) -> list[str]:
    """The class names an export holds, in label order; none for one without (synthetic data, older exports)."""
    try:
        names = json.loads(metadata.get(CLASSES, "[]"))
    except ValueError:  # damaged: the class numbers still say which class it is
        return []
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else []


@dataclass
class Exported:
    """What an export holds: its model (not built yet), its weights by layer, and its tokenizer's bytes."""

    spec: ModelSpec
    state: dict[str, torch.Tensor]
    dtype: str
    tokenizer: bytes | None
    metadata: dict[str, str]

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Sequential:
        """The model's layers in one sequence with the exported weights, in eval mode, computing in `dtype`."""
        why = misfit(self.spec, self.state)
        if why is not None:  # load_state_dict would raise a page of every mismatch
            raise ValueError(f"its weights do not fit its model ({why})")
        model = nn.Sequential(*self.spec.build_all())
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"its weights do not fit its model ({len(missing)} missing, e.g. "
                             f"{(missing or ['-'])[0]}; {len(unexpected)} unexpected)")
        return model.to(dtype).eval()


def parse(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Exported:
    """The export these tensors and metadata make up; ValueError names what is missing or wrong."""
    from gpipe_cli.models.registry import build_model

    meta = metadata or {}
    if MARK not in meta:
        if meta.get("layers") == LAYERS:
            raise WeightsOnly("it holds the weights alone, without the model they belong to (its run had no "
                              "recipe.yaml when it was exported)")
        raise ValueError("it has no gpipe model description in its metadata")
    version = meta[MARK]
    if version != VERSION:
        if version.isascii() and version.isdigit() and int(version) > int(VERSION):
            raise NewerFormat(f"it was written by a newer gpipe-cli (export format {version}; this one reads "
                              f"{VERSION})")
        raise ValueError(f"its export format {version!r} is not {VERSION!r}, the one this version reads")
    task, tasks = meta.get("task"), get_args(Task)
    if task not in tasks:  # what predict does follows from the task: an unknown one must not pass for another
        what = "it names no task" if task is None else f"its task {task!r} is none that this gpipe-cli runs"
        raise ValueError(f"{what} ({', '.join(tasks)})")
    try:
        config: dict[str, Any] = json.loads(meta["model"])
        aliases: dict[str, str] = json.loads(meta.get("tied", "{}"))
        spec = build_model(config.pop("kind"), **config)
        tokenizer = base64.b64decode(meta["tokenizer"], validate=True) if "tokenizer" in meta else None
    except (KeyError, ValueError, TypeError, binascii.Error) as exc:
        raise ValueError(f"its model description is damaged ({exc})") from None
    if spec.task != task:
        raise ValueError(f"its model description is damaged (task {task!r}, but its model's is {spec.task!r})")
    absent = [first for first in aliases.values() if first not in tensors]
    if absent:
        raise ValueError(f"its tie map names {absent[0]}, which it does not hold")
    # Every name of the tie map present again: the same tensor under each name.
    state = {**tensors, **{alias: tensors[first] for alias, first in aliases.items()}}
    return Exported(spec, state, meta.get("dtype", ""), tokenizer, meta)
