"""Pre-layer-norm Transformer pipeline layers; masks travel in the tuple with the activations."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.models.losses import PAD_ID
from gpipe_cli.models.transformer.attention import (
    MultiHeadAttention,
    causal_mask,
    key_mask,
    sinusoidal_positions,
)
from gpipe_cli.pipeline.dropout import Dropout

# Between layers, encoder-decoder: (source states [N,S,d], source keep [N,S], target states [N,T,d], target keep
# [N,T]), encoder layers updating the first, decoder layers the third; decoder-only: (states [N,T,d], keep [N,T]).
# "keep" (bool) is True at real tokens and False at padding (token id 0).
Positions = Literal["sinusoidal", "learned"]


class FeedForward(nn.Module):
    """Linear, ReLU, dropout, linear; `init_scale` shrinks the initial weights for deep stacks."""

    def __init__(self, d_model: int, ff: int, dropout: float, init_scale: float = 1.0) -> None:
        super().__init__()
        self.inner = nn.Linear(d_model, ff)
        self.outer = nn.Linear(ff, d_model)
        self.dropout = Dropout(dropout)
        for linear in (self.inner, self.outer):
            nn.init.xavier_uniform_(linear.weight, gain=init_scale)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.dropout(F.relu(self.inner(x))))


class Embedding(nn.Module):
    """Token embedding (scaled by sqrt(d)) plus positions and dropout; also derives the padding masks."""
    # `two_streams`: (source ids, target input ids), both through the one table the encoder-decoder shares.

    def __init__(self, vocab_size: int, d_model: int, max_len: int, positions: Positions,
                 dropout: float, two_streams: bool) -> None:
        super().__init__()
        self.d_model, self.max_len, self.two_streams = d_model, max_len, two_streams
        self.embed = nn.Embedding(vocab_size, d_model)
        # Unit-variance inputs after the sqrt(d) scale; a tied softmax then starts with O(1) logits.
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        self.position: nn.Embedding | None = None
        if positions == "learned":
            self.position = nn.Embedding(max_len, d_model)
            nn.init.normal_(self.position.weight, std=0.02)
        self.dropout = Dropout(dropout)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.two_streams:
            source, target = inputs
            return (*self.stream(source), *self.stream(target))
        assert isinstance(inputs, torch.Tensor)
        return self.stream(inputs)

    def stream(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One stream's embedded tokens and its padding mask."""
        length = ids.shape[1]
        x = self.embed(ids) * math.sqrt(self.d_model)
        if self.position is None:
            x = x + sinusoidal_positions(length, self.d_model, x.device, x.dtype)
        else:
            if length > self.max_len:
                raise ValueError(f"sequence length {length} exceeds max_len {self.max_len} "
                                 "of the learned positions")
            x = x + self.position.weight[:length]
        return self.dropout(x), ids != PAD_ID


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward blocks, each pre-normed and residual; `final_norm` closes the stack."""

    def __init__(self, d_model: int, ff: int, heads: int, dropout: float, ff_init_scale: float = 1.0,
                 final_norm: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ff, dropout, ff_init_scale)
        self.dropout = Dropout(dropout)
        self.final_norm = nn.LayerNorm(d_model) if final_norm else None

    def forward(self, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, keep, *rest = states
        h = self.norm1(x)
        x = x + self.dropout(self.attention(h, h, key_mask(keep)))
        x = x + self.dropout(self.ffn(self.norm2(x)))
        if self.final_norm is not None:
            x = self.final_norm(x)
        return (x, keep, *rest)


class DecoderLayer(nn.Module):
    """Causal self-attention, optional encoder-decoder attention, and feed-forward, all pre-normed."""

    def __init__(self, d_model: int, ff: int, heads: int, dropout: float, ff_init_scale: float = 1.0,
                 cross_attention: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attention = MultiHeadAttention(d_model, heads)
        self.cross_norm: nn.LayerNorm | None = None
        self.cross_attention: MultiHeadAttention | None = None
        if cross_attention:
            self.cross_norm = nn.LayerNorm(d_model)
            self.cross_attention = MultiHeadAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ff, dropout, ff_init_scale)
        self.dropout = Dropout(dropout)

    def forward(self, states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.cross_attention is None:
            y, keep = states
            return (self._decode(y, keep, None, None), keep)
        memory, memory_keep, y, keep = states
        return (memory, memory_keep, self._decode(y, keep, memory, memory_keep), keep)

    def _decode(self, y: torch.Tensor, keep: torch.Tensor, memory: torch.Tensor | None,
                memory_keep: torch.Tensor | None) -> torch.Tensor:
        h = self.norm1(y)
        y = y + self.dropout(self.self_attention(h, h, causal_mask(keep)))
        if self.cross_attention is not None and self.cross_norm is not None:
            assert memory is not None and memory_keep is not None
            y = y + self.dropout(self.cross_attention(self.cross_norm(y), memory, key_mask(memory_keep)))
        return y + self.dropout(self.ffn(self.norm2(y)))


class Softmax(nn.Module):
    """Final layer norm and the projection to vocabulary logits, optionally clipped to [-c, c]."""

    def __init__(self, d_model: int, vocab_size: int, logit_clip: float | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        # Same shape as the embedding table so the two can be tied.
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.proj.weight, std=d_model ** -0.5)
        self.logit_clip = logit_clip

    def forward(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # The decoder's states are the second-to-last element in both tuple layouts.
        logits = self.proj(self.norm(states[-2]))
        if self.logit_clip is not None:
            logits = logits.clamp(-self.logit_clip, self.logit_clip)
        return logits
