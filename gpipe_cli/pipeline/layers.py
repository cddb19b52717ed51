"""Build a stage's layers alone, so that every partition of a model starts from the same weights."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm
from gpipe_cli.pipeline.dropout import Dropout

# In-place fills whose meta kernels are torch's Python references: the first such call imports its compiler (about
# 2 s, each time a command describes a model on the meta device, as nn.Embedding's initialisation did).
# nn.init's are named too: a mode does not see the calls made inside one it passed on.
_VALUE_FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.erfinv_, torch.Tensor.clamp_, torch.Tensor.exponential_,
                          torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.geometric_, nn.init.normal_,
                          nn.init.trunc_normal_})


class _NoFillsOnMeta(TorchFunctionMode):
    """Leaves meta tensors' values unfilled: they have none, only shapes."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _VALUE_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device, shapes only: no memory, no initial values."""
    with torch.device("meta"), _NoFillsOnMeta():
        yield


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
        with torch.random.fork_rng(devices=[]), on_meta() if device.type == "meta" else nullcontext():
            torch.manual_seed(layer_seed(seed, i))
            layer = DeferredBatchNorm.convert(factories[i]()).to(device)
        for name, module in layer.named_modules():
            if isinstance(module, Dropout):
                module.rng_key = zlib.crc32(f"{seed}/{i}.{name}".encode())
        layers.append(layer)
    return layers
