"""Shared helpers for the model tests: running a layer list whole, from a cut, or per micro-batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.registry import build_model, resolve_preset


def build_preset(name: str, **overrides: Any) -> ModelSpec:
    """Build preset `name`, with `overrides` replacing individual parameters, as a recipe naming it does."""
    kind, params = resolve_preset(name, **overrides)
    return build_model(kind, **params)


def build_layers(spec: ModelSpec, seed: int = 0) -> list[nn.Module]:
    """Build every layer of `spec` on the CPU, each under its own seed as the engine does."""
    layers = []
    for index, layer in enumerate(spec.layers):
        torch.manual_seed(seed + index)
        layers.append(layer.build())
    for group in spec.tied:
        # Single process: tied parameters are one tensor.
        first = _parameter_owner(layers, group[0])
        for name in group[1:]:
            module, attr = _parameter_owner(layers, name)
            setattr(module, attr, getattr(first[0], first[1]))
    return layers


def _parameter_owner(layers: list[nn.Module], qualified: str) -> tuple[nn.Module, str]:
    index, _, name = qualified.partition(".")
    *path, attr = name.split(".")
    module = layers[int(index)]
    for part in path:
        module = getattr(module, part)
    return module, attr


def run(layers: list[nn.Module], x: Any, start: int = 0, stop: int | None = None) -> Any:
    """Run layers[start:stop] in sequence, checking each returns a tensor or a tuple of tensors."""
    for layer in layers[start:stop]:
        x = layer(x)
        assert is_batch(x), f"{type(layer).__name__} returned {type(x).__name__}"
    return x


def is_batch(x: Any) -> bool:
    """Whether `x` is a tensor or a non-empty tuple of tensors."""
    if isinstance(x, torch.Tensor):
        return True
    return isinstance(x, tuple) and len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)


def split(x: Any, sizes: list[int]) -> list[Any]:
    """Split a tensor or a tuple of tensors into micro-batches along dim 0."""
    if isinstance(x, torch.Tensor):
        return list(x.split(sizes))
    parts = [t.split(sizes) for t in x]
    return [tuple(p[i] for p in parts) for i in range(len(sizes))]


def cat(chunks: list[Any]) -> Any:
    """Concatenate micro-batch outputs back into one batch."""
    if isinstance(chunks[0], torch.Tensor):
        return torch.cat(chunks)
    return tuple(torch.cat([c[i] for c in chunks]) for i in range(len(chunks[0])))


def detached(x: Any) -> Any:
    """A copy of `x` as a receiving stage would see it: new leaf tensors, floats requiring grad."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.requires_grad_() if t.is_floating_point() else t
    return leaf(x) if isinstance(x, torch.Tensor) else tuple(leaf(t) for t in x)


def assert_close(a: Any, b: Any, **kwargs: Any) -> None:
    """Compare two tensors or tuples of tensors."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, **kwargs)
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **kwargs)


def check_every_cut(spec: ModelSpec, inputs: Any, micro_batches: list[int]) -> None:
    """Run the model whole, then from every cut with the boundary split into micro-batches; compare."""
    layers = build_layers(spec)
    for layer in layers:
        layer.eval()  # running statistics and no dropout: the output must not depend on the split
    with torch.no_grad():
        boundaries = [inputs]
        for layer in layers:
            boundaries.append(run([layer], boundaries[-1]))
        expected = boundaries[-1]
        for cut in range(len(layers) + 1):
            outputs = [run(layers, chunk, start=cut) for chunk in split(boundaries[cut], micro_batches)]
            assert_close(cat(outputs), expected, rtol=1e-4, atol=1e-5)
    # Gradients flow back across any cut into the received activations.
    for layer in layers:
        layer.train()
    for cut in range(1, len(layers)):
        with torch.no_grad():
            received = detached(run(layers, inputs, stop=cut))
        out = run(layers, received, start=cut)
        logits = out if isinstance(out, torch.Tensor) else out[0]
        logits.float().sum().backward()
        grads = [t.grad for t in ([received] if isinstance(received, torch.Tensor) else received)
                 if t.is_floating_point()]
        assert any(g is not None for g in grads), f"no gradient flows back across cut {cut}"
