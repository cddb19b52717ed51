"""Read a file written by `gpipe export`, refusing in one line anything that is not one."""

from __future__ import annotations

from pathlib import Path

from gpipe_cli.data.sources import first_line
from gpipe_cli.errors import UserError, shown
from gpipe_cli.models.weights import Exported, parse

_WRITE_ONE = "write one with: gpipe export RUN"


def load_export(path: str) -> Exported:
    """The export at `path`: its model description, weights and tokenizer."""
    from safetensors import SafetensorError, safe_open

    file = Path(path)
    if not path or not file.exists():
        raise UserError(f"no such model file: {shown(path)}; {_WRITE_ONE}")
    if file.is_dir():
        raise UserError(f"{shown(path)} is a directory; give the safetensors file gpipe export wrote")
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safetensors handle)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise UserError(f"{shown(path)} is not a safetensors file ({first_line(exc)}); {_WRITE_ONE}") from None
    try:
        return parse(tensors, metadata)
    except ValueError as exc:
        raise UserError(f"{shown(path)} is not a gpipe export: {exc}; {_WRITE_ONE}") from None
