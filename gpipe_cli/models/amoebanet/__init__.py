"""AmoebaNet-D and AmoebaNet-B image classifiers as pipeline layer sequences."""

from gpipe_cli.models.amoebanet.network import build_amoebanet

__all__ = ["build_amoebanet"]
