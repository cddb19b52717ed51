"""Layers built alike, priced once: a key equal for equal layer calls fed inputs of equal shapes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline.memory import storage_key

Tensors = Sequence[torch.Tensor | None]
# Per output: None, ("input", j) for input j handed on unchanged, or ("new", shape, dtype, requires_grad).
Outputs = tuple[tuple[Any, ...] | None, ...]


class _Unlike(Exception):
    """An argument that cannot be compared: the layer is priced on its own."""


def _frozen(value: Any) -> Hashable:
    """`value` as a hashable, equal for equal arguments (a tensor by its shape: the meta device has no data)."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype, value.requires_grad
    if isinstance(value, (tuple, list)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    try:
        hash(value)
    except TypeError:
        raise _Unlike from None
    return value  # a function by identity: the key holds it, so its identity is not reused


def _inputs_key(tensors: Tensors) -> Hashable:
    """The inputs' shapes, layouts and types, and which of them share storage."""
    keys = [storage_key(t) if t is not None else None for t in tensors]
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, keys.index(keys[i]))
                 for i, t in enumerate(tensors))


def alike_key(factory: Callable[[], nn.Module], tensors: Tensors, *more: Hashable) -> Hashable | None:
    """A key equal for layers built by equal calls and fed alike inputs (and `more`); None: price it on its own."""
    # A model's layers are partials of their class (pipeline/layers.py builds them); a layer's seed changes its
    # weights' values, never their shapes.
    if not isinstance(factory, functools.partial):
        return None
    try:
        call = factory.func, _frozen(factory.args), _frozen(factory.keywords)
    except _Unlike:
        return None
    return call, _inputs_key(tensors), more


def outputs_of(tensors: Tensors, outputs: Tensors) -> Outputs | None:
    """How `outputs` are made from `tensors`, to be made again alike; None when one is a view that cannot be."""
    inputs = {storage_key(t): j for j, t in enumerate(tensors) if t is not None}
    made: list[tuple[Any, ...] | None] = []
    new: set[int] = set()
    for out in outputs:
        if out is None:
            made.append(None)
            continue
        key = storage_key(out)
        if key in inputs:
            given = tensors[inputs[key]]
            assert given is not None
            if (out.shape, out.stride(), out.storage_offset()) != (given.shape, given.stride(), given.storage_offset()):
                return None
            made.append(("input", inputs[key]))
        elif key in new or not out.is_contiguous() or out.storage_offset() != 0 or \
                out.untyped_storage().nbytes() != out.numel() * out.element_size():
            return None  # a view of another output, or of a larger storage: made whole, it would count otherwise
        else:
            new.add(key)
            made.append(("new", tuple(out.shape), out.dtype, out.requires_grad))
    return tuple(made)


def remade(outputs: Outputs, tensors: Tensors) -> list[torch.Tensor | None]:
    """Outputs as `outputs_of` described them, from these inputs, on the meta device."""
    return [None if how is None else tensors[how[1]] if how[0] == "input"
            else torch.empty(how[1], dtype=how[2], device="meta").requires_grad_(how[3]) for how in outputs]
