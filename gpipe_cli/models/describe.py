"""Per-layer cost estimates for any ModelSpec, computed on the meta device without allocating."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpipe_cli.models.base import Batch, ModelSpec
from gpipe_cli.pipeline.alike import Outputs, alike_key, outputs_of, remade
from gpipe_cli.pipeline.layers import on_meta
from gpipe_cli.pipeline.stage import as_tensors, from_tensors

aten = torch.ops.aten


def _numel(shape: Any) -> int:
    """Elements of a shape, or of the first shape of a tuple of output shapes."""
    if isinstance(shape, (tuple, list)) and shape and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1


def _pooling(input_shape: Any, kernel: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    area = math.prod(kernel) if isinstance(kernel, (tuple, list)) else kernel * kernel
    return _numel(out_shape) * area


# FlopCounterMode counts only matrix products and convolutions. Elementwise work, normalisation and
# pooling are added (one FLOP per element touched) so that layers made mostly of those, such as an
# embedding lookup or pooling-heavy cells, do not appear free.
_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {
    **dict.fromkeys((aten.add, aten.sub, aten.mul, aten.div, aten.relu, aten.clamp, aten.clamp_min, aten.where,
                     aten.exp, aten.sin, aten.cos), lambda *args, out_shape=None, **kwargs: _numel(out_shape)),
    **dict.fromkeys((aten.mean, aten.sum), lambda input_shape, *args, **kwargs: _numel(input_shape)),
    # Mean, variance, subtract, divide, scale and shift: about five operations per element.
    **dict.fromkeys((aten.native_layer_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
                     aten._native_batch_norm_legit_no_training),
                    lambda input_shape, *args, **kwargs: 5 * _numel(input_shape)),
    **dict.fromkeys((aten.max_pool2d_with_indices, aten.avg_pool2d), _pooling),
}


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs: parameters, forward FLOPs and output size, the latter two per example."""

    index: int
    name: str
    params: int
    param_bytes: int
    flops: int
    activation_bytes: int
    output_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ModelSummary:
    """Per-layer costs of a model plus totals; tied parameters are counted once in `total_params`."""

    name: str
    task: str
    batch_size: int
    input_bytes: int
    layers: tuple[LayerCost, ...]
    total_params: int
    total_flops: int

    def stage_flops(self, start: int, stop: int) -> int:
        """Forward FLOPs per example of a stage running layers [start, stop)."""
        return sum(layer.flops for layer in self.layers[start:stop])


def tensors_of(value: Batch) -> list[torch.Tensor]:
    """The tensors in a tensor or a (nested) tuple or list of tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    raise TypeError(f"a layer must return a tensor or a tuple of tensors (got {type(value).__name__})")


def batch_bytes(value: Batch, batch_size: int) -> int:
    """Bytes per example of the tensors in `value` (tensors without the batch dimension count whole)."""
    sizes = [(t.numel() * t.element_size(), t.dim() > 0 and t.shape[0] == batch_size > 0) for t in tensors_of(value)]
    return sum(size // batch_size if per_example else size for size, per_example in sizes)


def _param_stats(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def _tied_copies(spec: ModelSpec, index: int, module: nn.Module) -> int:
    """Parameters of layer `index` counted more than once: the later copies of a tied tensor."""
    copies = {name for group in spec.tied for name in group[1:]}
    return sum(p.numel() for name, p in module.named_parameters() if f"{index}.{name}" in copies)


def tie_groups(spec: ModelSpec) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Each tied group's layer indices and the parameters of one copy, building its first layer on the meta device."""
    out = []
    for group in spec.tied:
        index, name = group[0].split(".", 1)
        with on_meta():
            numel = spec.layers[int(index)].build().get_parameter(name).numel()
        out.append((tuple(int(member.split(".", 1)[0]) for member in group), numel))
    return tuple(out)


def layer_params(spec: ModelSpec) -> list[int]:
    """The parameter count of every layer, building each alone on the meta device."""
    with on_meta():
        return [_param_stats(layer.build())[0] for layer in spec.layers]


def count_parameters(spec: ModelSpec) -> int:
    """The model's parameter count (tied tensors once), without allocating any of them."""
    with on_meta():
        modules = [layer.build() for layer in spec.layers]
    return sum(_param_stats(module)[0] - _tied_copies(spec, index, module) for index, module in enumerate(modules))


def describe(spec: ModelSpec, batch_size: int = 1) -> ModelSummary:
    """Parameters, forward FLOPs and output bytes of every layer for a batch of `batch_size` examples."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer (got {batch_size})")
    inputs, _ = spec.example_batch(batch_size, "meta")
    tied = 0
    costs = []
    x = inputs
    # Alike layers fed alike are counted once (a recipe may have 10,000); a tied copy's layer is always built.
    seen: dict[Hashable, tuple[int, int, int, Outputs, bool]] = {}
    copies = {int(name.split(".", 1)[0]) for group in spec.tied for name in group[1:]}
    with on_meta(), torch.no_grad():
        for index, layer in enumerate(spec.layers):
            given, bare = as_tensors(x)
            key = alike_key(layer.build, given, bare)
            if key is not None and key in seen and index not in copies:
                flops, params, param_bytes, again, bare = seen[key]
                x = from_tensors(remade(again, given), bare)
            else:
                module = layer.build()
                params, param_bytes = _param_stats(module)
                tied += _tied_copies(spec, index, module)
                counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS)
                with counter:
                    x = module(x)
                flops = counter.get_total_flops()
                made, bare = as_tensors(x)
                how = outputs_of(given, made) if key is not None else None
                if how is not None:
                    seen[key] = flops, params, param_bytes, how, bare
            costs.append(LayerCost(index=index, name=layer.name, params=params, param_bytes=param_bytes,
                                   flops=flops // batch_size,
                                   activation_bytes=batch_bytes(x, batch_size),
                                   output_shapes=tuple(tuple(t.shape) for t in tensors_of(x))))
    return ModelSummary(name=spec.name, task=spec.task, batch_size=batch_size,
                        input_bytes=batch_bytes(inputs, batch_size), layers=tuple(costs),
                        total_params=sum(c.params for c in costs) - tied, total_flops=sum(c.flops for c in costs))
