"""Paths checked before use, and files written whole or not at all with the permissions the umask gives."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from gpipe_cli.errors import PATH_SHOWN_CHARS, UserError, shown, shown_path
from gpipe_cli.runs import kept_by_a_run
from gpipe_cli.units import human_bytes

# Linux's limits, in bytes: of one name in a path, and of a whole path (PATH_MAX counts the closing NUL too).
NAME_MAX = 255
PATH_MAX = 4095
ALLOWED_LENGTHS = f"a name may have at most {NAME_MAX} bytes, a path at most {PATH_MAX} bytes"


def path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why no file system holds `path`, as words that follow it, e.g. "has a name of 300 bytes; ..." (None: none)."""
    # Python 3.11's pathlib raises ENAMETOOLONG from is_dir() and exists(): checked before any of them is asked.
    raw = os.fsencode(path)
    if len(raw) > PATH_MAX:
        return f"is {len(raw)} bytes long; {ALLOWED_LENGTHS}"
    longest = max(len(name) for name in raw.split(b"/"))
    return f"has a name of {longest} bytes; {ALLOWED_LENGTHS}" if longest > NAME_MAX else None


# The longest path a run writes below its folder: checkpoints/superseded-<time>-at-step-<step>/step-<step>/
# __<rank>_0.distcp, with room to spare.
RUN_FILES_BYTES = 100


def check_room_below(path: Path, what: str, below: int = RUN_FILES_BYTES) -> None:
    """Refuse a folder whose path leaves no room for the `below` bytes of paths written in it (the checkpoints)."""
    # Legal itself, it failed only at the first checkpoint, after the steps before it: their work was lost.
    full = len(os.fsencode(os.path.abspath(path)))
    if full + below > PATH_MAX:
        raise UserError(f"{what}: {shown(os.fsdecode(path), PATH_SHOWN_CHARS)} is {full} bytes long as a full path, "
                        f"and the run's checkpoint files lie up to {below} bytes below it; a path may have at most "
                        f"{PATH_MAX} bytes: give a shorter one")


def check_not_empty(path: str | os.PathLike[str] | None, what: str, names: str = "file",
                    give: str = "name one") -> None:
    """Refuse an empty path in one line naming `what` (a flag) and what it names: pathlib would read it as '.'."""
    if path is not None and not os.fspath(path):
        raise UserError(f"{what}: an empty path names no {names}; {give}")


def check_file_name(path: str | None, what: str) -> None:
    """Refuse a file to write named as a folder (`x.png/`, `x.png/.`), in one line naming `what`: pathlib drops both."""
    if path is None:
        return
    name = path.rstrip(os.sep)
    while name.endswith(os.sep + "."):
        name = name[:-1].rstrip(os.sep)
    # A folder by that name: the check of the output itself says so, and what to name in it.
    if name != path and name and not os.path.isdir(path):
        raise UserError(f"{what}: {shown(path, PATH_SHOWN_CHARS)} names a folder (the trailing '{path[len(name):]}'), "
                        f"and {what} names a file; give {shown(name, PATH_SHOWN_CHARS)}")


def check_path(path: str | os.PathLike[str] | None, what: str, names: str = "file", give: str = "name one") -> None:
    """Refuse, in one line naming `what` (a flag), a path no file system holds: empty, or a name or all too long."""
    check_not_empty(path, what, names, give)
    if path is None:
        return
    problem = path_problem(path)
    if problem is not None:
        raise UserError(f"{what}: {shown(os.fsdecode(path), PATH_SHOWN_CHARS)} {problem}")


def too_long_line(filename: object) -> str:
    """The line for a "File name too long" that no check foresaw: the path the system refused, and what is allowed."""
    if not isinstance(filename, (str, bytes)) or not filename:
        return f"a file name is too long; {ALLOWED_LENGTHS}"
    path = os.fsdecode(filename)
    problem = path_problem(path) or f"is too long for its file system (on most, {ALLOWED_LENGTHS})"
    return f"{shown(path, PATH_SHOWN_CHARS)} {problem}"


def _read_only(folder: Path) -> bool:
    """Whether `folder` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_writable(path: Path, what: str, instead: str = "") -> None:
    """Refuse an output directory that cannot be created or written, without leaving anything behind."""
    # `instead`: what to do, where the user named no folder (`; give --output-dir DIR ...`).
    check_path(path, what)
    existing = path
    while not os.path.exists(existing) and existing != existing.parent:  # os.path: no errors on long names
        if os.path.islink(existing):  # a dangling link: mkdir would fail later
            raise UserError(f"{what}: {shown(str(existing))} is a broken link")
        existing = existing.parent
    if not os.path.isdir(existing):
        raise UserError(f"{what}: {shown(str(existing))} exists and is not a directory{instead}")
    if not os.access(existing, os.W_OK | os.X_OK):
        how = "is on a read-only file system" if _read_only(existing) else "is not writable"
        raise UserError(f"{what}: {shown(str(existing))} {how}{instead}")
    try:  # access() says yes to root on a read-only file system's permission bits: try it for real
        with tempfile.TemporaryFile(dir=existing, prefix=".gpipe-probe-"):
            pass
    except OSError as exc:  # ENOENT for a folder that exists: a file system that takes no new files (/proc)
        why = "it takes no new files" if exc.errno == errno.ENOENT else exc.strerror
        raise UserError(f"{what}: cannot write to {shown(str(existing))} ({why}){instead}") from None


# The random characters mkstemp and mkdtemp put between a temporary name's prefix and suffix.
_RANDOM_CHARS = 8


def umask() -> int:
    """The process's file-creation mask."""
    # Linux reports it without changing it; os.umask can only be read by setting it
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_folders(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents, as `mkdir -p` does; those it made, nearest first."""
    # Not pathlib's or os.makedirs's: they recurse once a level, and a path of 4095 bytes can be 2047 deep.
    missing = []
    while not os.path.isdir(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for each in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made meanwhile; a file there fails at the write that follows
                each.mkdir()
                made.insert(0, each)
    except BaseException:  # a name too long, a full disk: the folders made so far go too
        remove_folders(made)
        raise
    return made


def remove_folders(made: list[Path]) -> None:
    """Remove the empty folders `make_folders` made, nearest first (one another writer filled stays)."""
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _room(path: Path, suffix: str) -> int:
    """The bytes of `path`'s name that a temporary name beside it can repeat (negative: its folder leaves none)."""
    folder = len(os.fsencode(os.path.join(path.parent, "")))
    return min(NAME_MAX, PATH_MAX - folder) - len(os.fsencode(suffix)) - _RANDOM_CHARS - 2


def hidden_prefix(path: Path, suffix: str = "") -> str:
    """`.NAME.`, the prefix of a temporary name beside `path`, NAME cut so that the name fits where `path`'s does."""
    # A legal name of 246 to 255 bytes would otherwise make a temporary one over NAME_MAX, and a path near
    # PATH_MAX one over that; the random part keeps a cut name apart from others.
    room = _room(path, suffix)
    name = path.name
    while name and len(os.fsencode(name)) > room:  # whole characters: a cut one would not be UTF-8
        name = name[:-1]
    return f".{name}."


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = "") -> Iterator[Path]:
    """A hidden file name beside `path` for the block to write, renamed to `path` when it ends, removed if it fails."""
    made = make_folders(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=hidden_prefix(path, suffix), suffix=suffix, dir=path.parent)
        try:
            os.close(fd)
            yield Path(tmp)
            # The mode `open()` gives a new file, not mkstemp's 0o600 (set after: a writer may make the file anew).
            os.chmod(tmp, 0o666 & ~umask())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except BaseException:  # a failed write leaves no folder it made (a full disk left a/b/ behind)
        remove_folders(made)
        raise


@contextlib.contextmanager
def atomic_path_of_a_writer(path: Path) -> Iterator[Path]:
    """As `atomic_path`, for a writer that makes temporary files of its own beside what it writes (safetensors):
    all go in a hidden folder named by this process, which the next such write removes once its process is gone."""
    prefix = hidden_prefix(path, ".d")[:-1]
    for stale in path.parent.glob(f"{glob.escape(prefix)}.*.d"):  # a write killed with -9 left one (the model's size)
        with contextlib.suppress(ValueError, OSError):
            if not _alive(int(stale.suffixes[-2][1:])):
                shutil.rmtree(stale)
    made = make_folders(path.parent)
    folder = path.parent / f"{prefix}.{os.getpid()}.d"
    try:
        folder.mkdir()
        try:
            yield folder / path.name
            os.chmod(folder / path.name, 0o666 & ~umask())  # as `open()` makes a file; a writer's temporary is 0o600
            os.replace(folder / path.name, path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    except BaseException:  # as atomic_path: a failed write leaves no folder it made
        remove_folders(made)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file so that it either exists whole or not at all (write to a temporary file, then rename)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` whole or not at all."""
    atomic_write_bytes(path, text.encode("utf-8"))


def space_left(folder: Path) -> str:
    """What a failed write's line says of the disk: 'N free on FOLDER', or that FOLDER cannot be read."""
    try:
        return f"{human_bytes(shutil.disk_usage(folder).free)} free on {folder}"
    except OSError:
        return f"{folder} cannot be read"


def check_output(path: Path | None, flag: str, example: str = "out.json", hint: str = "") -> None:
    """Refuse, before any work and in one line naming `flag` and `path`, a file `atomic_write` could not write."""
    # An empty `flag`: a default place the user never named; `hint` then ends the line with what to do instead.
    if path is None:
        return
    check_not_stdout(path, flag, "file", example, hint)
    where = _cannot_write(path, flag)
    problem = path_problem(path)
    if problem is not None:  # before pathlib is asked anything about it
        raise UserError(f"{where}: it {problem}{hint}")
    if _room(path, "") < 0:
        raise UserError(f"{where}: its folder's path leaves no room for the temporary file it is written to first "
                        f"(a path may have at most {PATH_MAX} bytes); name a shorter folder{hint}")
    if (kept := kept_by_a_run(path)) is not None:
        run, what = kept
        raise UserError(f"{flag + ' ' if flag else ''}{shown_path(path)} {what}; name another file, e.g. "
                        f"{shown_path(run / example)}{hint}")
    if os.path.islink(path):  # the rename would replace the link itself: /dev/stdout is one, to a terminal or a pipe
        raise UserError(f"{where}: it is a symbolic link, which the write would replace rather than follow; name "
                        f"the file itself{hint}")
    if os.path.isdir(path):  # os.path: no errors on names too long or looping links
        raise UserError(f"{where}: it is a directory; name a file, e.g. {shown_path(path / example)}{hint}")
    if os.path.exists(path) and not os.path.isfile(path):  # a device or a FIFO: the rename would replace it
        raise UserError(f"{where}: it exists and is not a regular file; name a regular file or a new one{hint}")
    try:  # its folder, or the nearest existing parent atomic_write would fill
        check_writable(path.parent, where)
    except UserError as exc:
        raise UserError(f"{exc}{hint}") from None


def check_not_stdout(path: str | Path | None, flag: str, names: str, example: str, hint: str = "") -> None:
    """Refuse, in one line naming `flag`, an output named '-'; `names`: what to name instead, e.g. `example`."""
    if path is not None and str(path) == "-":  # stdout's name to many commands: the write would make a '-' instead
        raise UserError(f"{_cannot_write(Path(path), flag)}: outputs are written to files, never to stdout; name a "
                        f"{names}, e.g. {example}{hint}")


def _cannot_write(path: Path, flag: str) -> str:
    """The start of a line refusing `path`: "--json: cannot write 'x'" (no flag: a default place)."""
    return (f"{flag}: " if flag else "") + f"cannot write {shown_path(path)}"


@contextlib.contextmanager
def writing(path: Path, flag: str, hint: str = "") -> Iterator[None]:
    """One line for an OSError the block raises writing `path`: a full disk, a folder gone since the check."""
    try:
        yield
    except OSError as exc:  # atomic_write has left nothing behind
        raise UserError(f"{_cannot_write(path, flag)} ({exc.strerror or exc}){hint}") from None


_KINDS = {".yaml": "a recipe's YAML", ".yml": "a recipe's YAML", ".json": "a JSON", ".jsonl": "a JSON lines",
          ".png": "an image's", ".pdf": "a PDF", ".svg": "an SVG", ".safetensors": "a safetensors"}


def check_output_kind(path: Path | None, flag: str, writes: str = "JSON", suffix: str = ".json",
                      allowed: tuple[str, ...] = (".json", ".jsonl")) -> None:
    """Refuse an output named as a file of another kind, or an existing file that is not one the flag writes."""
    if path is None:
        return
    instead = f"name a {suffix} file, e.g. {shown_path(path.with_suffix(suffix))}"
    if path.suffix.lower() in _KINDS.keys() - allowed:  # `bench --json recipes/quickstart.yaml` wrote over it
        raise UserError(f"{flag} {shown_path(path)} has {_KINDS[path.suffix.lower()]} name, and {flag} writes "
                        f"{writes}; {instead}")
    # `validate --json README.md` replaced the README: a file of any other name is kept unless it holds what is written.
    if path.suffix.lower() not in allowed and os.path.isfile(path) and not _holds(path, writes):
        raise holds_no(path, flag, writes, instead)


def holds_no(path: Path, flag: str, writes: str, instead: str) -> UserError:
    """The refusal of an existing file that holds no `writes`, which the output `flag` would replace."""
    return UserError(f"{flag} {shown_path(path)} is a file that holds no {writes}, which {flag} would replace; "
                     f"{instead}, or remove that file first")


def check_picture(path: Path, would: str, instead: str) -> None:
    """Refuse an existing file at a picture's path (PNG, PDF or SVG, by its suffix) that holds no such picture."""
    kind = path.suffix.lower().lstrip(".")
    writes = f"{kind.upper() if kind in ('pdf', 'svg') else 'PNG'} image"
    if os.path.isfile(path) and not _holds(path, writes):  # `--trace t.json` replaced someone's notes at t.png
        raise UserError(f"{would} {shown_path(path)}, a file that holds no {writes}; {instead}, or remove that file "
                        "first")


_STARTS = {"PNG image": (b"\x89PNG",), "PDF image": (b"%PDF",), "SVG image": (b"<?xml", b"<svg")}


def _holds(path: Path, writes: str) -> bool:
    """Whether an existing file begins as `writes` (JSON, safetensors or a picture) does, or is empty."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:  # unreadable: the write says why it cannot replace it
        return True
    if writes == "safetensors":  # a little-endian header length, then the header's JSON
        return not head or head[8:9] == b"{"
    if writes in _STARTS:
        return not head or head.lstrip().startswith(_STARTS[writes])
    return not head.strip() or head.lstrip()[:1] in (b"{", b"[")


def write_json(path: Path, data: Any, flag: str = "--json") -> None:
    """`data` as indented JSON at `path`, whole or not at all; an OSError (a disk filled since) in one line."""
    with writing(path, flag):
        atomic_write_text(path, json.dumps(data, indent=2))


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two names reach one existing file (another spelling, a link); False when either is missing."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # missing, unreadable, or a name no file system takes
        return False


def another_file(path: Path, name: str) -> str:
    """What a refusal of `path` suggests instead: `name` in the same folder."""
    return f"name another file, e.g. {shown_path(path.with_name(name))}"


# `inputs`: each file the command reads (None: none there) and what it is, e.g. "the recipe itself".
def check_not_input(path: Path | None, flag: str, inputs: Iterable[tuple[str | Path | None, str]],
                    instead: str) -> None:
    """Refuse, before any work and in one line naming `flag`, an output that is a file the command itself reads."""
    if path is None:
        return
    for source, what in inputs:
        if source is not None and same_file(path, source):
            raise UserError(f"{flag} {shown_path(path)} is {what}: writing there would replace it; {instead}")
