"""`gpipe predict`: use an exported model in one process, without the pipeline or torch.distributed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

from gpipe_cli.errors import UserError, as_typed, not_utf8, shell_path, shown_path
from gpipe_cli.files import check_path
from gpipe_cli.pipeline.streams import write_out
from gpipe_cli.runs import CHECKPOINTS, EXPORTED, PREFIX, SUPERSEDED, is_run, newest_step, run_dir_of
from gpipe_cli.train.existing import course_export

DEFAULT_MAX_TOKENS = 50
MAX_TOKENS = 100_000  # a long document's worth: each token is a forward, so a typo of more digits runs for days
_KINDS = {"translation": "a translation model", "lm": "a language model", "image": "an image classifier"}
_GIVE = {"translation": "a sentence to translate", "lm": "a prompt to continue"}


def predict(path: str, inputs: list[str] | None = None, max_tokens: int | None = None, top: int | None = None) -> int:
    """Print one line per input (None: stdin's) of the export at `path`: translation, continuation or top classes."""
    # Found before torch loads (seconds), as a mistake is everywhere else.
    file = export_file(path)
    if sys.stdout is None:  # started with it closed (`>&-`): the answers would go nowhere
        raise UserError("standard output is closed: predict prints its answers there; give it a file or a pipe")
    if hasattr(sys.stdout, "reconfigure"):  # answers in UTF-8, as inputs are read: a C locale escaped "zéro"
        sys.stdout.reconfigure(encoding="utf-8")
    if inputs is None and sys.stdin is None:  # `<&-`: no line to read
        raise UserError("standard input is closed and no input was given: give the inputs as arguments, or one "
                        "per line on stdin")
    if max_tokens is not None and not 1 <= max_tokens <= MAX_TOKENS:
        raise UserError(f"--max-tokens: must be >= 1 and <= {MAX_TOKENS:,} (got {max_tokens})")
    from gpipe_cli import interrupts

    with interrupts.deferred():  # torch's import runs Python from C++, where a Ctrl-C is lost or aborts the process
        from gpipe_cli.predict import tasks

    exported = tasks.load_export(path)
    behind = out_of_date(file, exported.metadata.get("step"))
    if behind is not None:
        print(f"[gpipe] {behind}", file=sys.stderr)
    task = exported.spec.task
    if max_tokens is not None and task != "lm":
        raise UserError(f"--max-tokens continues a language model's prompt; {shown_path(path)} is {_KINDS[task]}")
    if top is not None and task != "image":
        raise UserError(f"--top ranks an image classifier's classes; {shown_path(path)} is {_KINDS[task]}")
    if inputs is not None and task != "image":  # an image's path stays as the file system names it
        inputs = [as_typed(item) for item in inputs]
    given = inputs or []
    for number, item in enumerate(given, 1):  # found before the model is built, not after
        if task == "image":
            tasks.check_image_path(item)
        else:
            _check_text(item, number, len(given), task)
            tasks.not_an_image(item, "translation" if task == "translation" else "language")
    try:
        model = exported.build()
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    if task == "translation":
        answer = tasks.translator(exported, model)
    elif task == "lm":
        answer = tasks.generator(exported, model, max_tokens or DEFAULT_MAX_TOKENS)
    else:
        answer = tasks.classifier(exported, model, 1 if top is None else top)
    if inputs is None and sys.stdin.isatty():
        print(f"[gpipe] {_KINDS[task]}: reading inputs from stdin, one per line (Ctrl-D ends)", file=sys.stderr)
    answered, begun = 0, False
    try:
        for item in inputs if inputs is not None else _stdin_lines(text=task != "image"):
            written, nothing = False, None
            try:
                for piece in answer(item):  # each piece as soon as it is known: stdin may be a conversation, and a
                    write_out(piece)  # long continuation shows as it grows (and ends once its reader has gone)
                    begun, written = True, written or bool(piece)
            except tasks.NoAnswer as exc:
                nothing = str(exc)
            write_out("\n")
            answered, begun = answered + 1, False
            if nothing is not None:
                print(f"[gpipe] input {answered}: {nothing}", file=sys.stderr, flush=True)
            else:
                _say_if_empty(answered, item, written)
    except KeyboardInterrupt:
        if begun:  # the answer cut short still ends its line
            write_out("\n")
        if not answered and not begun:
            raise  # the command's own line: nothing was answered
        said = (f"during answer {answered + 1}, its line cut short" if begun
                else f"after {answered} answer{'' if answered == 1 else 's'}")
        print(f"gpipe predict: interrupted {said}", file=sys.stderr)
        return 130
    return 0


def _say_if_empty(number: int, item: str, written: bool) -> None:
    """Note on stderr an answer the model left empty: its empty line alone would read as a fault of the command."""
    if not written and item.strip():  # a blank line of stdin is answered with a blank line on purpose
        print(f"[gpipe] input {number}: the model produced no tokens (it may need more training)", file=sys.stderr,
              flush=True)


def _check_text(item: str, number: int, count: int, task: str) -> None:
    """Refuse an INPUT of a text model that is blank or not UTF-8, naming it as "INPUT 2 of 3" (of several)."""
    which = f"INPUT {number} of {count}" if count > 1 else "INPUT"
    if not item.strip():  # its answer was a blank line and exit code 0, as if something had been asked
        raise UserError(f"{which}: {'only whitespace' if item else 'empty'}; give {_GIVE[task]}")
    where = not_utf8(item)  # bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer refuses
    if where is not None:
        raise UserError(f"{which}: not UTF-8 text ({where}); give {_GIVE[task]} in UTF-8")


def _stdin_lines(text: bool) -> Iterator[str]:
    """stdin's lines; of a text model, each checked to be UTF-8 where its line number can still be said."""
    if hasattr(sys.stdin, "reconfigure"):  # UTF-8 whatever the locale; bytes that are not are said below
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
    for number, line in enumerate(sys.stdin, 1):
        item = line.rstrip("\r\n")
        where = not_utf8(item) if text else None  # an image's path may be any bytes
        if where is not None:
            raise UserError(f"an input is not UTF-8 text ({where}) on line {number} of stdin; give sentences in UTF-8")
        yield item


def out_of_date(file: Path, exported_step: str | None) -> str | None:
    """Why a run's own export is not of its newest checkpoint, in one line (None: it is, or it is no run's)."""
    # Training on (or a resume from an earlier step) writes checkpoints, never the export: it can lag behind.
    run_dir = file.parent
    if file.name != EXPORTED or not (run_dir / CHECKPOINTS).is_dir() or not exported_step \
            or not exported_step.isdigit():
        return None
    newest = newest_step(run_dir)
    if newest is None or newest == int(exported_step):
        return None
    return (f"{file} is the export of step {exported_step}, but the run's newest checkpoint is step {newest}: "
            f"answering with step {exported_step}'s weights; refresh it with: gpipe export {shell_path(run_dir)}")


def export_command(file: Path) -> str:
    """The command that writes the export `file` names: `gpipe export` of its run directory, where it is in one."""
    run = next((folder for folder in (file, file.parent) if folder.is_dir() and is_run(folder)), None)
    return f"gpipe export {shell_path(run) if run is not None else 'RUN'}"


def export_file(path: str) -> Path:
    """The file of the export `path` names (a run directory: its model.safetensors); one line refuses none."""
    check_path(path, "MODEL", "model", "give the file gpipe export wrote, or its run directory")
    file = Path(path)
    if not file.exists():
        raise UserError(f"no such model file: {shown_path(path)}; write one with: {export_command(file)}")
    if file.is_dir():  # a run directory: the file gpipe export writes there by default
        if file.name.startswith(SUPERSEDED) and course_export(file).is_file():  # what its export wrote
            file = course_export(file)
        elif file.name.startswith(SUPERSEDED) or (file.name.startswith(PREFIX) and (file / "manifest.json").is_file()):
            # A checkpoint, or a course a resume set aside: its export goes in its run (the advice was
            # `gpipe export RUN`, or to export the folder, and then the same refusal).
            course = file if file.name.startswith(SUPERSEDED) else file.parent
            written = course_export(course) if course.name.startswith(SUPERSEDED) else run_dir_of(path) / EXPORTED
            what = "a checkpoint" if file.name.startswith(PREFIX) else "a course of checkpoints a resume set aside"
            raise UserError(f"{shown_path(path)} is {what}, and predict reads an export: write one with: gpipe "
                            f"export {shell_path(path)}, then give predict {shell_path(written)}")
        elif not (file / EXPORTED).is_file():
            raise UserError(f"{shown_path(path)} is a directory without {EXPORTED}; write one with: "
                            f"{export_command(file)}")
        else:
            file = file / EXPORTED
    try:  # safetensors words a file it may not read as one that is not there
        open(file, "rb").close()
    except OSError as exc:
        raise UserError(f"cannot read {shown_path(str(file))} ({exc.strerror or exc})") from None
    return file
