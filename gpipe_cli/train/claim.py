"""A run directory held by the one `gpipe train` that writes it, so that a second one into it is refused."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

from gpipe_cli.errors import UserError, cut
from gpipe_cli.pipeline import stopping

LOCK = ".gpipe-train.lock"  # in the run directory while a gpipe train holds it; removed as that one ends
_TRIES = 100  # claims lost to a holder that ended meanwhile (it removes its lock file): each then tries again


# The lock is an flock on a file in the directory: it ends with the process that holds it, however that process
# ends, so a failed launch never leaves a claim behind. `flag` names the directory in a refusal, `instead` ends it;
# `made`: the caller has just made `run_dir` for this run. One made for the run and left with only its set-up goes.
@contextlib.contextmanager
def held(run_dir: Path, flag: str, instead: str, made: bool = False, parents: Sequence[Path] = ()) -> Iterator[bool]:
    """Hold `run_dir` in the block (made if missing), refusing one another gpipe train holds; yields if it is new."""
    # `parents`: the folders above it made with it (else those missing now), removed with it while empty.
    parents = list(parents) or missing(run_dir.parent)
    fd, created = _claim(run_dir, flag, instead, made)

    def undo() -> None:  # a stop that ends this process where it waits inside torch: no `finally` runs
        if fd is not None:
            _remove(fd, run_dir / LOCK)
        if created:
            from gpipe_cli.train.existing import remove_set_up

            remove_set_up(run_dir, parents=parents)

    cancel = stopping.on_abrupt_exit(undo)
    try:
        yield created
    finally:
        cancel()
        undo()  # a run that never started leaves nothing behind; a folder with anything else in it stays
        if fd is not None:
            os.close(fd)


def missing(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist, nearest first."""
    found = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        found.append(folder)
    return found


def _claim(run_dir: Path, flag: str, instead: str, made: bool) -> tuple[int | None, bool]:
    """The locked file's descriptor (None: no lock can be taken here) and whether the directory is new."""
    created = made
    for _ in range(_TRIES):
        try:
            run_dir.mkdir(parents=True)
            created = True
        except FileExistsError:
            pass
        except OSError:  # cannot be made: the checks that follow say why in their own line
            return None, created
        try:
            fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:  # a run that never started removed its directory meanwhile
            continue
        except OSError:  # e.g. a directory this user cannot write: the checks that follow refuse it
            return None, created
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise being_written(run_dir, flag, holder, instead) from None
        except OSError:  # a file system without locks (some network mounts): the directory is not held
            os.close(fd)
            return None, created
        if _ours(fd, run_dir / LOCK):
            with contextlib.suppress(OSError):  # who holds it, for another launch's line; a full disk is said next
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            return fd, created
        os.close(fd)  # its holder ended and removed it after this process opened it: lock the file there now
    return None, created


def being_written(run_dir: Path, flag: str, holder: str, instead: str) -> UserError:
    """The refusal of `run_dir`, named by `flag`, while another gpipe train (`holder`) writes it."""
    return UserError(f"{flag}: {cut(str(run_dir), 200)} is being written by another gpipe train ({holder}); {instead}")


def writer_of(run_dir: Path) -> str | None:
    """The gpipe train that holds `run_dir` now, as `_holder` names it (None: none does)."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken only where no holder has it, and let go at once
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _remove(fd: int, path: Path) -> None:
    """Remove the lock file `fd` holds, unless another file has taken its name."""
    # Removed while still held: a claim that opened it meanwhile finds it gone once it gets the lock, and tries anew.
    if _ours(fd, path):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _ours(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open as `fd` (its holder removes it as it ends)."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """The process that holds the lock, as its file names it: "pid N", with its host where that is another."""
    try:
        pid, _, host = os.pread(fd, 300, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid.isdigit():  # it has just taken the lock and not yet written its name
        return "one that has just started"
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
