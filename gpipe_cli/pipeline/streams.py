"""Standard output that cannot take what is written, told apart from a file a command writes."""

# Importing this module costs nothing: the command line asks it while the command is failing, before torch loads.
from __future__ import annotations

import errno
import sys
import traceback

_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)  # a full disk, a quota, a file too large, a device


class StdoutRefused(OSError):
    """Standard output refused a write made through `write_out`."""


def write_out(text: str) -> None:
    """Write `text` to standard output at once; its refusal is raised as StdoutRefused (print's leaves no trace)."""
    if sys.stdout is None:  # started with it closed (`>&-`): nowhere to say it, as print does
        return
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        if exc.errno not in _REFUSED or isinstance(exc, StdoutRefused):
            raise  # a closed pipe stays a BrokenPipeError: `| head` ends quietly
        raise StdoutRefused(exc.errno, exc.strerror) from None


def stdout_refused(exc: BaseException) -> bool:
    """Whether `exc` is standard output refusing a write (`> /dev/full`, a log whose disk filled)."""
    if not isinstance(exc, OSError) or exc.errno not in _REFUSED or sys.stdout is None:
        return False
    if isinstance(exc, StdoutRefused):
        return True
    try:  # the stream that raised: standard output itself (a guarded one), or the file of rich's console
        writers = (frame.f_locals.get("self") for frame, _ in traceback.walk_tb(exc.__traceback__))
        if any(w is sys.stdout or getattr(w, "file", None) is sys.stdout for w in writers):
            return True
        sys.stdout.flush()  # print's: what it could not write is still buffered, and fails again
    except OSError:
        return True
    except Exception:  # an odd object in a frame: not ours to judge
        return False
    return False
