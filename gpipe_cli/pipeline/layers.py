"""Build a stage's layers alone, so that every partition of a model starts from the same weights."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm
from gpipe_cli.pipeline.dropout import Dropout


def layer_seed(seed: int, index: int) -> int:
    """The RNG seed layer `index` is initialised with, whatever stage builds it."""
    return zlib.crc32(f"gpipe/{seed}/layer/{index}".encode())


def build_layers(factories: Sequence[Callable[[], nn.Module]], indices: Sequence[int], seed: int,
                 device: torch.device | str = "cpu") -> list[nn.Module]:
    """Build only the given layers, each from its own seed: every partition, on any device, starts alike."""
    device = torch.device(device)
    layers = []
    for i in indices:
        # Initialised by the CPU generator, then moved: a CUDA generator draws other numbers from the
        # same seed, and a run must start from the same weights on every device.
        # On the meta device (shapes only) the layer is built there: no weights allocated or initialised.
        with torch.random.fork_rng(devices=[]), torch.device("meta") if device.type == "meta" else nullcontext():
            torch.manual_seed(layer_seed(seed, i))
            layer = DeferredBatchNorm.convert(factories[i]()).to(device)
        for name, module in layer.named_modules():
            if isinstance(module, Dropout):
                module.rng_key = zlib.crc32(f"{seed}/{i}.{name}".encode())
        layers.append(layer)
    return layers
