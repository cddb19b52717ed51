"""`gpipe profile-memory`: per-stage parameters, gradients, optimizer state and activations; budget search."""

from gpipe_cli.profile.options import FLAGS, ProfileOptions, parse_partitions
from gpipe_cli.profile.runner import run

__all__ = ["FLAGS", "ProfileOptions", "parse_partitions", "run"]
