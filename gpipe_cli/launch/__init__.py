"""Start K × D ranks under torchrun's elastic agent, or run directly when already under torchrun."""

from gpipe_cli.launch.launcher import LaunchOptions, launch, under_torchrun

__all__ = ["LaunchOptions", "launch", "under_torchrun"]
