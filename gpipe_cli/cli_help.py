"""Help texts as a person reads them: a word for what each option takes (never a type name), no stray spaces."""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape

# What an option takes, by parameter name; the rest by type. Flags take nothing and show nothing.
_METAVARS = {
    "recipe": "RECIPE", "run": "RUN", "set_": "KEY=VALUE", "set": "KEY=VALUE", "output_dir": "DIR", "output": "FILE",
    "nnodes": "N", "node_rank": "N", "rdzv_endpoint": "HOST:PORT", "rdzv_backend": "static|c10d",
    "rdzv_id": "ID", "threads": "N", "resume": "RUN", "json_file": "FILE", "json": "FILE", "trace": "FILE",
    "model": "MODEL", "partitions": "K", "microbatches": "M", "schedule": "NAME", "checkpoint": "MODE",
    "balance": "N,N,...", "optimizer": "NAME", "budget": "SIZE", "device": "DEVICE", "bandwidth": "GB/S",
    "latency_us": "US", "device_memory": "SIZE", "node_bandwidth": "GB/S", "node_latency_us": "US",
    "timing": "MODE", "tflops": "TFLOP/S", "runs": "RUN_DIR", "offload": "MODE",
}
_BY_TYPE = {"int": "N", "float": "X", "Path": "PATH", "str": "VALUE", "list[str]": "VALUE"}
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+([,;:)]|\.(?![.\w]))")  # ".png" is a suffix, not a full stop


def tidy(text: str | None) -> str | None:
    """One paragraph: single spaces, none before punctuation, brackets shown as written (not as markup)."""
    if text is None:
        return None
    return escape(_SPACE_BEFORE_PUNCTUATION.sub(r"\1", " ".join(text.split())))


def polish(command: Any) -> Any:
    """Give every option of `command` and its subcommands a readable placeholder and tidy help."""
    command.help = tidy(command.help)
    command.short_help = tidy(command.short_help)
    context = type(command).context_class(command, info_name=command.name)
    help_option = command.get_help_option(context)
    params = [*command.params, *([help_option] if help_option is not None else [])]
    for param in params:
        if param.param_type_name == "argument":
            # Typer shows an argument's type (`<str>`) beside its name whatever the metavar; the name says it.
            param.display_type_rich = lambda ctx: None
            if hasattr(param, "_usage_display_name"):  # typer's `{RUN}` for a required one reads as a choice
                param._usage_display_name = _usage_name(param)
        if getattr(param, "is_flag", False) or getattr(param, "count", False):
            param.metavar = ""
        elif param.metavar:  # one given where the option is declared: it knows best (prepare-data's DIR)
            pass
        elif param.name in _METAVARS:
            param.metavar = _METAVARS[param.name]
        else:
            kind = param.bare_type() if hasattr(param, "bare_type") else ""
            param.metavar = _BY_TYPE.get(kind, "VALUE")
        if hasattr(param, "help"):
            param.help = tidy(param.help)
    for sub in getattr(command, "commands", {}).values():
        polish(sub)
    return command


def _usage_name(param: Any) -> Any:
    """How an argument shows in the usage line: RUN when required, [RUN] when not, ... when it takes several."""
    return lambda: (f"{param.display_name_raw}" if param.required else f"[{param.display_name_raw}]") \
        + ("..." if param.nargs != 1 else "")
