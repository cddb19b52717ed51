"""Tiny exports of each model family written directly, without training: fast inputs for `gpipe predict`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from gpipe_cli.data.tokenizer import train_tokenizer
from gpipe_cli.models.registry import build_model
from gpipe_cli.models.weights import describe, store_once

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "hundred", "thousand"]
# Weights of some seeds translate into nothing (the end token first), which predict notes on stderr: with this
# one the translation model answers every input the tests give it, so their stderr holds only what they expect.
SEED = 1
SIZES = {
    "translation": dict(kind="transformer", arch="encoder-decoder", layers=1, d_model=16, ff=32, heads=2,
                        vocab_size=64, max_len=24, tie_embeddings=True),
    "lm": dict(kind="transformer", arch="decoder-only", layers=1, d_model=16, ff=32, heads=2, vocab_size=64,
               max_len=12, positions="learned"),
    "image": dict(kind="amoebanet", layers=3, filters=4, image_size=32, num_classes=3),
}


def write_export(folder: Path, family: str, **metadata_changes: str | None) -> Path:
    """An export of a freshly initialised model of `family`; `metadata_changes` replace (None: drop) keys."""
    params = dict(SIZES[family])
    spec = build_model(params.pop("kind"), **params)
    with torch.random.fork_rng():  # the same weights every time, leaving the tests' own random numbers as they are
        torch.manual_seed(SEED)
        tensors = {k: v.contiguous() for k, v in nn.Sequential(*spec.build_all()).state_dict().items()}
    for first, *others in spec.tied:  # as the engine ties them: one tensor under every name
        tensors.update({alias: tensors[first] for alias in others})
    tensors, aliases = store_once(tensors, spec.tied)
    tokenizer = None
    if family != "image":
        text = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5)) for i in range(200)]
        tokenizer = train_tokenizer(text, 60)._proto
    meta = describe(spec, aliases, dtype="float32", step=0, recipe="name: tiny\n", tokenizer=tokenizer)
    for key, value in metadata_changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    path = folder / f"{family}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path
