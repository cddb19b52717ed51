"""Dropout whose masks depend on the example, not on how the mini-batch was split or partitioned."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.pipeline import context

_MASK64 = (1 << 64) - 1
_LEVELS = 1 << 16
# SplitMix64's increment (2^64 over the golden ratio) steps from one example's seed to the next; another odd
# increment steps from one word of an example's mask to the next, so the two sequences do not share a stride.
_EXAMPLE_STEP = 0x9E3779B97F4A7C15
_WORD_STEP = 0xD1B54A32D192ED03
# SplitMix64's finaliser: xor with a right shift, then a multiply, twice; a last xor-shift brings the
# product's well-mixed high bits down into the low ones.
_ROUNDS: tuple[tuple[int, int | None], ...] = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as `value`: torch takes no Python scalar at or above 2^63."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def mix64(value: int) -> int:
    """SplitMix64's finaliser of a 64-bit integer, on the host."""
    value &= _MASK64
    for shift, multiplier in _ROUNDS:
        value ^= value >> shift
        if multiplier is not None:
            value = (value * multiplier) & _MASK64
    return value


def mix64_(words: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`mix64` of every element of an int64 tensor, in place, with a scratch tensor of the same shape."""
    for shift, multiplier in _ROUNDS:
        torch.bitwise_right_shift(words, shift, out=scratch)
        # torch shifts int64 arithmetically: clearing the copies of the sign bit makes it the logical shift.
        scratch &= (1 << (64 - shift)) - 1
        words ^= scratch
        if multiplier is not None:
            words *= _signed(multiplier)  # int64 products wrap modulo 2^64, as the unsigned ones do
    return words


def mask_words(key: int, step: int, offset: int, scratch: torch.Tensor) -> torch.Tensor:
    """Uniform random int64 words, a row per example from `offset` on, a function of (key, step, example, column)."""
    # `scratch`, int64 in the result's shape, is overwritten. Integer arithmetic: the same words on every device.
    rows, columns = scratch.shape
    # The layer and the step only move the base, so they are mixed once here rather than per element.
    base = mix64(mix64(key) ^ step)
    seeds = torch.arange(offset, offset + rows, dtype=torch.int64, device=scratch.device)
    seeds.mul_(_signed(_EXAMPLE_STEP)).add_(_signed(base))
    mix64_(seeds, torch.empty_like(seeds))
    counters = torch.arange(1, columns + 1, dtype=torch.int64, device=scratch.device).mul_(_signed(_WORD_STEP))
    # The contiguous operand first: on the CPU the broadcast sum runs about twice as fast that way round.
    return mix64_(torch.add(counters, seeds[:, None]), scratch)


class Dropout(nn.Module):
    """Inverted dropout; inside the engine each example's mask is a function of (layer, step, example)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1) (got {p})")
        self.p = p
        # The engine assigns a key from the layer's global position; modules built alone keep 0.
        self.rng_key = 0

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
        """The scaled keep mask of `x` in its dtype, from each example's own row of `mask_words`."""
        if x.is_meta:
            return torch.empty_like(x)  # shapes only
        rows, width = x.shape[0], math.prod(x.shape[1:])
        columns = -(-width // 4)
        keep = torch.empty(rows, width, dtype=x.dtype, device=x.device)
        # The mask's memory is the hash's scratch wherever it is large enough (in float32 for any width
        # but 1, in 16-bit dtypes for a multiple of 4), so the only other large allocation is the words':
        # on the CPU each fresh one costs a page fault per 4 KiB touched, on a GPU it raises the peak.
        spans = rows * columns * 8 // x.element_size()
        if spans <= keep.numel():
            scratch = keep.view(-1)[:spans].view(torch.int64).view(rows, columns)
        else:
            scratch = torch.empty(rows, columns, dtype=torch.int64, device=x.device)
        words = mask_words(self.rng_key, step, offset, scratch)
        # An element is dropped when its uniform 16-bit lane falls below `cut`: one 64-bit word masks four
        # elements, and the rate is p to within 1/65536. The comparison runs in place in the lanes' own
        # dtype, the fast one; written into another dtype it would go through a temporary.
        lanes = words.view(torch.int16)
        cut = min(round(self.p * _LEVELS), _LEVELS - 1)
        lanes.ge_(cut - _LEVELS // 2)
        # The mask is in x's dtype: the backward's product with it runs two to three times faster than
        # with a boolean one.
        keep.copy_(lanes[:, :width])
        return keep.mul_(_LEVELS / (_LEVELS - cut)).view(x.shape)
