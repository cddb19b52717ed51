"""`gpipe profile-memory`: per-stage parameters, gradients, optimizer state and activations; budget search."""

from gpipe_cli.profile.options import CUTS, FLAGS, ProfileOptions, parse_partitions, profile_options, validate

__all__ = ['CUTS', 'FLAGS', 'ProfileOptions', 'parse_partitions', 'profile_options', "run"]


def run(options: ProfileOptions) -> int:
    """Run `gpipe profile-memory`; its flags are checked before torch loads, so a mistake is said at once."""
    validate(options)
    from gpipe_cli.profile.runner import run as profile  # torch and the engine: only for flags that are good

    return profile(options)
