"""Training and evaluation data: sources, tokenizer and mini-batches that are identical on every rank."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpipe_cli.data.bleu import corpus_bleu
    from gpipe_cli.data.build import Task, build_data, build_data_for
    from gpipe_cli.data.loader import Batch, Examples, Loader
    from gpipe_cli.data.tokenizer import BOS, EOS, PAD, UNK, Tokenizer
    from gpipe_cli.errors import DataError

# Imported on first use, so that light submodules (the offline hub check, pydoc text) load without torch.
_NAMES = {"data.bleu": ("corpus_bleu",), "data.build": ("Task", "build_data", "build_data_for"),
          "data.loader": ("Batch", "Examples", "Loader"), "data.tokenizer": ("BOS", "EOS", "PAD", "UNK", "Tokenizer"),
          "errors": ("DataError",)}
_WHERE = {name: f"gpipe_cli.{module}" for module, names in _NAMES.items() for name in names}

__all__ = ["BOS", "EOS", "PAD", "UNK", "Batch", "DataError", "Examples", "Loader", "Task", "Tokenizer", "build_data",
           "build_data_for", "corpus_bleu"]


def __getattr__(name: str) -> Any:
    """A public name of the package, imported from its module on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gpipe_cli.data' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
