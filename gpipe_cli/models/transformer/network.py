"""The GPipe paper's Transformer T(L, H, A) and a decoder-only language model, as flat layer lists."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from gpipe_cli.models.base import Batch, LayerSpec, ModelSpec
from gpipe_cli.models.losses import count_tokens, token_cross_entropy
from gpipe_cli.models.transformer.layers import DecoderLayer, Embedding, EncoderLayer, Positions, Softmax

ARCHS = ("encoder-decoder", "decoder-only")
POSITIONS = ("sinusoidal", "learned")
FIRST_WORD_ID = 4  # ids 0-3 are padding, unk, bos, eos


def _build_embedding(vocab_size: int, d_model: int, max_len: int, positions: Positions,
                     dropout: float, two_streams: bool) -> nn.Module:
    return Embedding(vocab_size, d_model, max_len, positions, dropout, two_streams)


def _build_encoder(d_model: int, ff: int, heads: int, dropout: float, ff_init_scale: float,
                   final_norm: bool) -> nn.Module:
    return EncoderLayer(d_model, ff, heads, dropout, ff_init_scale, final_norm)


def _build_decoder(d_model: int, ff: int, heads: int, dropout: float, ff_init_scale: float,
                   cross_attention: bool) -> nn.Module:
    return DecoderLayer(d_model, ff, heads, dropout, ff_init_scale, cross_attention)


def _build_softmax(d_model: int, vocab_size: int, logit_clip: float | None) -> nn.Module:
    return Softmax(d_model, vocab_size, logit_clip)


def token_batch(n: int, device: torch.device | str, vocab_size: int, length: int,
                translation: bool) -> tuple[Batch, torch.Tensor]:
    """Random word ids: ((source, target input), target output) or (tokens, next tokens)."""
    if translation:
        source = torch.randint(FIRST_WORD_ID, vocab_size, (n, length), device=device)
        target = torch.randint(FIRST_WORD_ID, vocab_size, (n, length + 1), device=device)
        return (source, target[:, :-1]), target[:, 1:]
    tokens = torch.randint(FIRST_WORD_ID, vocab_size, (n, length + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def transformer_loss(output: Any, targets: torch.Tensor, label_smoothing: float = 0.1) -> torch.Tensor:
    """Label-smoothed token cross-entropy averaged over non-padding target tokens."""
    return token_cross_entropy(output, targets, label_smoothing)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive_int(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
           f"{name} must be a positive integer (got {value!r})")


def build_transformer(arch: str = "encoder-decoder", layers: int = 6, d_model: int = 1024,
                      ff: int = 4096, heads: int = 16, vocab_size: int = 32000, max_len: int = 256,
                      dropout: float = 0.1, positions: str = "sinusoidal", tie_embeddings: bool = False,
                      scaled_init: bool = False, logit_clip: float | None = None,
                      label_smoothing: float = 0.1) -> ModelSpec:
    """T(layers, ff, heads) with `d_model`-wide states, or the decoder-only LM built from the same layers."""
    _check(arch in ARCHS, f"transformer arch must be one of {', '.join(ARCHS)} (got {arch!r})")
    for name, value in (("layers", layers), ("d_model", d_model), ("ff", ff), ("heads", heads),
                        ("max_len", max_len)):
        _positive_int(name, value)
    _positive_int("vocab_size", vocab_size)
    _check(vocab_size > FIRST_WORD_ID, f"vocab_size must exceed {FIRST_WORD_ID} (got {vocab_size})")
    _check(d_model % heads == 0, f"d_model ({d_model}) must be divisible by heads ({heads})")
    _check(positions in POSITIONS, f"positions must be one of {', '.join(POSITIONS)} (got {positions!r})")
    _check(isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0,
           f"dropout must be in [0, 1) (got {dropout!r})")
    _check(isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 1.0,
           f"label_smoothing must be in [0, 1) (got {label_smoothing!r})")
    _check(logit_clip is None or (isinstance(logit_clip, (int, float)) and logit_clip > 0),
           f"logit_clip must be a positive number or null (got {logit_clip!r})")
    for name, flag in (("tie_embeddings", tie_embeddings), ("scaled_init", scaled_init)):
        _check(isinstance(flag, bool), f"{name} must be true or false (got {flag!r})")

    translation = arch == "encoder-decoder"
    # The paper's stability aid: shrink the feed-forward initialisation with depth (variance / L),
    # so the summed residual branches start at a depth-independent scale.
    ff_scale = 1.0 / math.sqrt(layers) if scaled_init else 1.0
    pos: Positions = "learned" if positions == "learned" else "sinusoidal"
    specs = [LayerSpec("embed", functools.partial(
        _build_embedding, vocab_size, d_model, max_len, pos, dropout, translation))]
    if translation:
        for i in range(layers):
            specs.append(LayerSpec(f"encoder_{i + 1}", functools.partial(
                _build_encoder, d_model, ff, heads, dropout, ff_scale, i == layers - 1)))
    prefix = "decoder" if translation else "layer"
    for i in range(layers):
        specs.append(LayerSpec(f"{prefix}_{i + 1}", functools.partial(
            _build_decoder, d_model, ff, heads, dropout, ff_scale, translation)))
    specs.append(LayerSpec("softmax", functools.partial(_build_softmax, d_model, vocab_size,
                                                        None if logit_clip is None else float(logit_clip))))

    tied: list[tuple[str, ...]] = []
    if tie_embeddings:
        tied.append(("0.embed.weight", f"{len(specs) - 1}.proj.weight"))
    config = dict(kind="transformer", arch=arch, layers=layers, d_model=d_model, ff=ff, heads=heads,
                  vocab_size=vocab_size, max_len=max_len, dropout=dropout, positions=positions,
                  tie_embeddings=tie_embeddings, scaled_init=scaled_init, logit_clip=logit_clip,
                  label_smoothing=label_smoothing)
    name = f"t-{layers}-{ff}-{heads}" if translation else f"lm-{layers}-{ff}-{heads}"
    return ModelSpec(
        name=name,
        task="translation" if translation else "lm",
        layers=specs,
        loss=functools.partial(transformer_loss, label_smoothing=label_smoothing),
        example_batch=functools.partial(token_batch, vocab_size=vocab_size, length=max_len,
                                        translation=translation),
        units=count_tokens,
        tied=tied,
        config=config,
    )
