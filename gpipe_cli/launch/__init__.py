"""Start K × D ranks under torchrun's elastic agent, or run directly when already under torchrun."""

from gpipe_cli.launch.launcher import LaunchOptions, NothingStarted, launch, launch_options, under_torchrun, warming
from gpipe_cli.launch.preflight import check_device, check_launch

__all__ = ["LaunchOptions", "NothingStarted", "check_device", "check_launch", "launch", "launch_options",
           "under_torchrun", "warming"]
