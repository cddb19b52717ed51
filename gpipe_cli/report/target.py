"""Where `gpipe report` writes its PNG, and the writing: a failure is one line, and the page is never half there."""

from __future__ import annotations

from pathlib import Path

from gpipe_cli.errors import UserError
from gpipe_cli.report import page
from gpipe_cli.report.runs import Run

# Said after a default place that cannot be written (a read-only run of someone else's, say).
ELSEWHERE = "; give --output FILE to write the page elsewhere"


def write(runs: list[Run], target: Path, flag: str = "", hint: str = "") -> None:
    """Draw the page into `target` (matplotlib is there, and `files.check_output` passed it); UserError when the
    write fails."""
    try:
        page.draw(runs, target)
    except OSError as exc:  # a disk can fill, or a folder change, after the check; the page is never half there
        where = (f"{flag}: " if flag else "") + f"cannot write {target}"
        raise UserError(f"{where} ({exc.strerror or exc}){hint}") from None
