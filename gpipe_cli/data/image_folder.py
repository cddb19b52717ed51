"""An image folder's splits, classes and files: `<split>/<class>/**/<image>`, or `<class>/**/<image>` alone."""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from gpipe_cli.errors import DataError, shown_path
from gpipe_cli.units import counted

# A top-level folder of one of these names (any case) is a split, under the name on the left. Only whole names
# count: a class "test tube" or "val_bird" is a class, and a split is never guessed from a deeper folder.
SPLIT_FOLDERS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
                 "test": ("test", "testing"), "eval": ("eval", "evaluation")}
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LAYOUT = "imagefolder wants <split>/<class>/*.png (train/, val/, test/) or <class>/*.png"


def split_name(name: str) -> str:
    """The split a folder or a data.*_split of this name means (its own name, in lower case, if none of ours)."""
    lower = name.lower()
    return next((split for split, names in SPLIT_FOLDERS.items() if lower in names), lower)


@dataclass(frozen=True)
class Folder:
    """Per split, its images (paths relative to the folder, in order) and their class numbers; the class names."""

    root: Path
    splits: dict[str, tuple[list[str], list[int]]]
    classes: list[str]


def skipped(name: str) -> bool:
    """Whether a file or folder of a data folder is no data (hidden, or an archive's __MACOSX/)."""
    # Hidden files and folders (.DS_Store, ._x.png, .thumbs/) and an unzipped archive's __MACOSX/ are no data.
    return name.startswith(".") or name == "__MACOSX"


def _images(folder: Path) -> list[str]:
    """Every image file below `folder`, as paths relative to it sorted folder by folder, past hidden folders."""
    found = []
    seen = {os.path.realpath(folder)}  # linked folders are followed, each once: a link to a folder above would loop
    for here, dirs, files in os.walk(folder, onerror=_unreadable, followlinks=True):
        dirs[:] = [d for d in dirs if not skipped(d) and _first_visit(os.path.join(here, d), seen)]
        under = os.path.relpath(here, folder)
        found += [f if under == "." else os.path.join(under, f) for f in files
                  if not skipped(f) and f.lower().endswith(IMAGE_EXTS)]
    return sorted(found, key=lambda path: path.split(os.sep))


def _first_visit(folder: str, seen: set[str]) -> bool:
    real = os.path.realpath(folder)
    if real in seen:
        return False
    seen.add(real)
    return True


def _unreadable(error: OSError) -> None:
    raise DataError(f"cannot read the folder {shown_path(error.filename)}: {error.strerror}")


def _listing(folder: Path) -> list[str]:
    try:
        return [entry.name for entry in os.scandir(folder) if entry.is_file()]
    except OSError as e:
        raise DataError(f"cannot read the folder {shown_path(str(folder))}: {e.strerror}") from None


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not skipped(p.name))
    except OSError as e:
        raise DataError(f"cannot read the folder {shown_path(str(folder))}: {e.strerror}") from None


def scan(root: Path, wanted: tuple[str, ...] = ()) -> Folder:
    """The splits, classes and images of the folder `root`; `wanted`: split names asked for besides ours."""
    tops = _subfolders(root)
    known = {*SPLIT_FOLDERS, *(split_name(w) for w in wanted)}
    split_dirs = [d for d in tops if split_name(d.name) in known]
    splits: dict[str, Path] = {}
    for d in split_dirs:
        name = split_name(d.name)
        if name in splits:
            raise DataError(f"'{splits[name].name}' and '{d.name}' under '{root}' are both the {name} split; keep one")
        splits[name] = d
    if split_dirs:  # every image then belongs to a split's class folder
        loose = [f for f in _listing(root) if not skipped(f) and f.lower().endswith(IMAGE_EXTS)]
        if loose:
            raise DataError(f"{counted(len(loose), 'image')} directly in '{root}' beside its split folders, in none "
                            f"of them (e.g. {sorted(loose)[0]}); {LAYOUT}")
        stray = [d for d in tops if d not in split_dirs and _images(d)]
        if stray:
            raise DataError(f"'{stray[0]}' holds images but is no split beside {', '.join(d.name for d in split_dirs)}:"
                            f" move them into a split's class folders, or remove it ({LAYOUT})")
    else:
        splits = {"train": root}
    found: dict[str, list[tuple[str, str]]] = {}
    for name, folder in splits.items():
        images = _images(folder)
        loose = [p for p in images if os.sep not in p]
        if loose:
            raise DataError(f"{counted(len(loose), 'image')} directly in '{folder}' not in a class folder (e.g. "
                            f"{loose[0]}); {LAYOUT}")
        under = os.path.relpath(folder, root)
        # A class by the name a person reads: macOS writes 'café' decomposed, Linux as typed; both are one class.
        found[name] = [(p if under == "." else os.path.join(under, p),
                        unicodedata.normalize("NFC", p.split(os.sep, 1)[0])) for p in images]
    found = {name: pairs for name, pairs in found.items() if pairs}  # an empty split is none, as a missing one
    classes = sorted({cls for pairs in found.values() for _, cls in pairs})
    number = {cls: i for i, cls in enumerate(classes)}
    return Folder(root, {name: ([path for path, _ in pairs], [number[cls] for _, cls in pairs])
                         for name, pairs in found.items()}, classes)
