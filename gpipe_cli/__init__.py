"""gpipe-cli: GPipe pipeline-parallel training driven by YAML recipes."""

__version__ = "0.1.0"
