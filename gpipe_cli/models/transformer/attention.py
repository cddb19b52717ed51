"""Multi-head attention over padded batches, and the masks and positions it needs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def key_mask(keep: torch.Tensor) -> torch.Tensor:
    """An attention mask [N, 1, 1, S] letting every query see the non-padding keys of its example."""
    return keep[:, None, None, :]


def causal_mask(keep: torch.Tensor) -> torch.Tensor:
    """An attention mask [N, 1, T, T] letting query t see the non-padding keys at positions <= t."""
    length = keep.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=keep.device).tril()
    return causal[None, None] & keep[:, None, None, :]


def sinusoidal_positions(length: int, dim: int, device: torch.device,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fixed sine/cosine position encodings of Vaswani et al., [length, dim]."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    half = dim // 2
    frequency = torch.exp(torch.arange(half, device=device, dtype=torch.float32)
                          * (-math.log(10000.0) / max(half - 1, 1)))
    angles = position * frequency[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    if dim % 2:
        table = F.pad(table, (0, 1))
    return table.to(dtype)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention with `heads` heads and biased q/k/v/output projections."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by the number of heads ({heads})")
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        for linear in (self.q, self.k, self.v, self.out):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, length, d = x.shape
        q = self._split(self.q(x))
        k = self._split(self.k(memory))
        v = self._split(self.v(memory))
        # A query with no visible key (an all-padding example) would get NaN from the softmax;
        # let it see every key instead. Its output is padding that the loss ignores anyway.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
        if q.device.type == "meta":
            # Shapes only, to price memory, as the fused kernels compute them: on meta torch picks the math path,
            # saving every head's attention weights (heads x length^2 per example); the fused kernels save the
            # inputs, the output and a log-sum-exp: priced the math way, a Transformer-L layer at length 1024 came
            # out gigabytes larger than it trains.
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
            y = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)[0]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(n, length, d))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        n, length, d = x.shape
        return x.view(n, length, self.heads, d // self.heads).transpose(1, 2)
