"""The GPipe paper's Transformer T(L, H, A) and a decoder-only language model, as flat layer lists."""

from __future__ import annotations

import functools
import math

import torch

from gpipe_cli.errors import shown
from gpipe_cli.limits import choices
from gpipe_cli.models.base import Batch, LayerSpec, ModelSpec, is_fraction, is_int, require
from gpipe_cli.models.losses import count_tokens, token_cross_entropy
from gpipe_cli.models.transformer.layers import DecoderLayer, Embedding, EncoderLayer, Positions, Softmax

ARCHS = ("encoder-decoder", "decoder-only")
POSITIONS = ("sinusoidal", "learned")
FIRST_WORD_ID = 4  # ids 0-3 are padding, unk, bos, eos


def token_batch(n: int, device: torch.device | str, vocab_size: int, length: int,
                translation: bool) -> tuple[Batch, torch.Tensor]:
    """Random word ids: ((source, target input), target output) or (tokens, next tokens)."""
    if translation:
        source = torch.randint(FIRST_WORD_ID, vocab_size, (n, length), device=device)
        target = torch.randint(FIRST_WORD_ID, vocab_size, (n, length + 1), device=device)
        return (source, target[:, :-1]), target[:, 1:]
    tokens = torch.randint(FIRST_WORD_ID, vocab_size, (n, length + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def build_transformer(arch: str = "encoder-decoder", layers: int = 6, d_model: int = 1024,
                      ff: int = 4096, heads: int = 16, vocab_size: int = 32000, max_len: int = 256,
                      dropout: float = 0.1, positions: str = "sinusoidal", tie_embeddings: bool = False,
                      scaled_init: bool = False, logit_clip: float | None = None,
                      label_smoothing: float = 0.1) -> ModelSpec:
    """T(layers, ff, heads) with `d_model`-wide states, or the decoder-only LM built from the same layers."""
    require(arch in ARCHS, f"arch must be {choices(ARCHS)} (got {shown(arch)})")
    for name, value in (("layers", layers), ("d_model", d_model), ("ff", ff), ("heads", heads),
                        ("max_len", max_len), ("vocab_size", vocab_size)):
        require(is_int(value) and value >= 1, f"{name} must be a positive integer (got {shown(value)})")
    require(vocab_size > FIRST_WORD_ID, f"vocab_size must exceed {FIRST_WORD_ID} (got {vocab_size})")
    require(d_model % heads == 0, f"d_model ({d_model}) must be divisible by heads ({heads})")
    require(positions in POSITIONS, f"positions must be {choices(POSITIONS)} (got {shown(positions)})")
    for name, share in (("dropout", dropout), ("label_smoothing", label_smoothing)):
        require(is_fraction(share), f"{name} must be a number in [0, 1) (got {shown(share)})")
    require(logit_clip is None or (isinstance(logit_clip, (int, float)) and logit_clip > 0),
            f"logit_clip must be a positive number or null (got {shown(logit_clip)})")
    for name, flag in (("tie_embeddings", tie_embeddings), ("scaled_init", scaled_init)):
        require(isinstance(flag, bool), f"{name} must be true or false (got {shown(flag)})")

    translation = arch == "encoder-decoder"
    # The paper's stability aid: shrink the feed-forward initialisation with depth (variance / L),
    # so the summed residual branches start at a depth-independent scale.
    ff_scale = 1.0 / math.sqrt(layers) if scaled_init else 1.0
    pos: Positions = "learned" if positions == "learned" else "sinusoidal"
    specs = [LayerSpec("embed", functools.partial(Embedding, vocab_size, d_model, max_len, pos, dropout, translation))]
    if translation:
        specs += [LayerSpec(f"encoder_{i + 1}", functools.partial(
            EncoderLayer, d_model, ff, heads, dropout, ff_scale, i == layers - 1)) for i in range(layers)]
    prefix = "decoder" if translation else "layer"
    specs += [LayerSpec(f"{prefix}_{i + 1}", functools.partial(
        DecoderLayer, d_model, ff, heads, dropout, ff_scale, translation)) for i in range(layers)]
    specs.append(LayerSpec("softmax", functools.partial(Softmax, d_model, vocab_size,
                                                        None if logit_clip is None else float(logit_clip))))

    tied: list[tuple[str, ...]] = [("0.embed.weight", f"{len(specs) - 1}.proj.weight")] if tie_embeddings else []
    return ModelSpec(
        name=f"t-{layers}-{ff}-{heads}" if translation else f"lm-{layers}-{ff}-{heads}",
        task="translation" if translation else "lm", layers=specs, units=count_tokens, tied=tied,
        loss=functools.partial(token_cross_entropy, label_smoothing=label_smoothing),
        example_batch=functools.partial(token_batch, vocab_size=vocab_size, length=max_len, translation=translation),
        config=dict(kind="transformer", arch=arch, layers=layers, d_model=d_model, ff=ff, heads=heads,
                    vocab_size=vocab_size, max_len=max_len, dropout=dropout, positions=positions,
                    tie_embeddings=tie_embeddings, scaled_init=scaled_init, logit_clip=logit_clip,
                    label_smoothing=label_smoothing))
