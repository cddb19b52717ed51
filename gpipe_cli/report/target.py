"""Where `gpipe report` writes its PNG: refused in one line, before anything is drawn, when it cannot be written."""

from __future__ import annotations

from pathlib import Path

from gpipe_cli.errors import UserError
from gpipe_cli.launch.preflight import check_writable
from gpipe_cli.report import page
from gpipe_cli.report.runs import Run

# Said after a default place that cannot be written (a read-only run of someone else's, say).
ELSEWHERE = "; give --output FILE to write the page elsewhere"


def check(target: Path, prefix: str = "", hint: str = "") -> None:
    """UserError naming `target` when it is not a file's place or its folder cannot be written (or created)."""
    if target.is_dir():
        raise UserError(f"{prefix}cannot write {target}: it is a directory; name a file, e.g. "
                        f"{target / 'report.png'}")
    if target.exists() and not target.is_file():  # a device or a FIFO: the rename would replace it
        raise UserError(f"{prefix}cannot write {target}: it is not a regular file{hint}")
    try:
        check_writable(target.parent, f"{prefix}cannot write {target}")
    except UserError as exc:
        raise UserError(f"{exc}{hint}") from None


def write(runs: list[Run], target: Path, prefix: str = "", hint: str = "") -> None:
    """Draw the page into `target` (matplotlib is there); UserError when the write fails."""
    try:
        page.draw(runs, target)
    except OSError as exc:  # a disk can fill, or a folder change, after the check; the page is never half there
        raise UserError(f"{prefix}cannot write {target} ({exc.strerror or exc}){hint}") from None
