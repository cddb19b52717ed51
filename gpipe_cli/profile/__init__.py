"""`gpipe profile-memory`: per-stage parameters, gradients, optimizer state and activations; budget search."""

from typing import Any

from gpipe_cli.profile.options import FLAGS, ProfileOptions, parse_partitions

__all__ = ['FLAGS', 'ProfileOptions', 'parse_partitions', "run"]


def __getattr__(name: str) -> Any:
    # `run` pulls in torch and the engine; the CLI's help only needs the options.
    if name == "run":
        from gpipe_cli.profile.runner import run

        return run
    raise AttributeError(name)
