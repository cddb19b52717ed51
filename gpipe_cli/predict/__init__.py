"""`gpipe predict`: use an exported model in one process, without the pipeline or torch.distributed."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from gpipe_cli.errors import UserError

DEFAULT_MAX_TOKENS = 50
_KINDS = {"translation": "a translation model", "lm": "a language model", "image": "an image classifier"}


@dataclass(frozen=True)
class PredictOptions:
    """The command's arguments: the export, the inputs (None: stdin's lines) and the per-task options."""

    model: str
    inputs: list[str] | None = None
    max_tokens: int | None = None
    top: int = 1


def predict(options: PredictOptions) -> int:
    """Print one line per input: its translation, its continuation, or its most likely classes."""
    from gpipe_cli.predict import tasks
    from gpipe_cli.predict.load import load_export

    exported = load_export(options.model)
    task = exported.task
    if options.max_tokens is not None and task != "lm":
        raise UserError(f"--max-tokens continues a language model's prompt; {options.model} is {_KINDS[task]}")
    if options.max_tokens is not None and options.max_tokens < 1:
        raise UserError(f"--max-tokens: {options.max_tokens} is not a positive number of tokens")
    if task == "image":
        for path in options.inputs or ():  # found before the model is built, not after
            tasks.check_image_path(path)
    try:
        model = exported.build()
    except ValueError as exc:
        raise UserError(f"{options.model}: {exc}") from None
    if task == "translation":
        answer = tasks.translator(exported, model)
    elif task == "lm":
        answer = tasks.generator(exported, model, options.max_tokens or DEFAULT_MAX_TOKENS)
    else:
        answer = tasks.classifier(exported, model, options.top)
    for item in _inputs(options.inputs, _KINDS[task]):
        print(answer(item), flush=True)  # each as soon as it is known: stdin may be a conversation
    return 0


def _inputs(given: list[str] | None, kind: str) -> Iterable[str]:
    """The inputs given, else stdin's lines."""
    if given is not None:
        return given
    if sys.stdin.isatty():
        print(f"[gpipe] {kind}: reading inputs from stdin, one per line (Ctrl-D ends)", file=sys.stderr)
    return (line.rstrip("\r\n") for line in sys.stdin)
