"""Dropout whose masks depend on the example, not on how the mini-batch was split or partitioned."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.pipeline import context

_MASK32 = 0xFFFFFFFF
_LEVELS = 1 << 16
_INT64_MIN = -(1 << 63)


def _mix(x: int) -> int:
    """A 32-bit integer hash (lowbias32) used to derive independent seeds."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def example_seed(key: int, step: int, example: int) -> int:
    """The generator seed of one example's mask in one layer at one step."""
    return _mix(_mix(_mix(key) ^ step) ^ example) | (_mix(example + 0x9E3779B9) << 32)


class Dropout(nn.Module):
    """Inverted dropout; inside the engine each example's mask is a function of (layer, step, example).

    That makes masks identical for any number of stages, micro-batches or data-parallel replicas,
    and identical between a forward and its recompute. Outside the engine it is plain dropout.
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1) (got {p})")
        self.p = p
        # The engine assigns a key from the layer's global position; modules built alone keep 0.
        self.rng_key = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        info = context.current()
        if info is None:
            return F.dropout(x, self.p, training=True)
        return x * self._mask(x, info.step, info.offset)

    def _mask(self, x: torch.Tensor, step: int, offset: int) -> torch.Tensor:
        """The scaled keep mask of `x` in its dtype, one generator seed per example (row)."""
        if x.is_meta:
            return torch.empty_like(x)  # shapes only: the meta device has no generator
        generator = self._generators.get(x.device)
        if generator is None:
            generator = self._generators[x.device] = torch.Generator(device=x.device)
        rows, width = x.shape[0], math.prod(x.shape[1:])
        words = torch.empty(rows, -(-width // 4), dtype=torch.int64, device=x.device)
        for row in range(rows):
            generator.manual_seed(example_seed(self.rng_key, step, offset + row))
            words[row].random_(_INT64_MIN, None, generator=generator)
        # An element is dropped when its uniform 16-bit lane falls below `cut`: one 64-bit draw masks four
        # elements, several times faster than a float draw each, and the rate is p to within 1/65536.
        lanes = words.view(torch.int16)[:, :width]
        cut = min(round(self.p * _LEVELS), _LEVELS - 1)
        # The mask is in x's dtype, compared straight into it: no boolean tensor to convert, and the
        # backward's product with it runs two to three times faster than with a boolean one.
        keep = torch.empty(rows, width, dtype=x.dtype, device=x.device)
        torch.ge(lanes, cut - _LEVELS // 2, out=keep)
        return keep.mul_(_LEVELS / (_LEVELS - cut)).view(x.shape)
