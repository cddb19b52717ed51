"""The GPipe paper's Transformer (encoder-decoder and decoder-only) as pipeline layer sequences."""

from gpipe_cli.models.transformer.network import build_transformer

__all__ = ["build_transformer"]
