"""Finding and opening data: local files and folders, the Hugging Face hub, splits and hold-outs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpipe_cli.data.image_folder import skipped
from gpipe_cli.data.offline import hub_problem, offline_flag
from gpipe_cli.data.rng import rng
from gpipe_cli.errors import DataError
from gpipe_cli.recipe.schema import SOURCE_FILES, Data

# Validation first: test splits may have hidden labels (imagenet-1k's are -1).
EVAL_SPLIT_NAMES = ("validation", "valid", "val", "dev", "test", "eval")  # as image folders name them


def existing_path(path: str | None, what: str) -> Path:
    """data.path as an existing Path, else a DataError naming it."""
    if not path:
        raise DataError(f"data.path is required for {what}")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path '{p}' does not exist")
    return p


def split_files(path: Path, exts: Sequence[str], data: Data) -> tuple[list[Path], list[Path] | None]:
    """(train files, eval files or None) of a file or a folder; split membership is by file name."""
    train_split, eval_split = data.train_split, data.eval_split
    named_split = train_split != Data.model_fields["train_split"].default  # the default also reads a plain folder
    if path.is_file():
        if eval_split or named_split:  # nothing to pick: the split would be ignored without a word
            key, default = ("data.eval_split", "null") if eval_split else ("data.train_split", "train")
            raise DataError(f"{key} picks files of a folder by name, and data.path '{path}' is one file: leave "
                            f"{key} out or --set {key}={default} (data.eval_fraction holds out that share of the "
                            f"file)")
        return [path], None
    files = data_files(path, exts)
    if not files:
        hidden = any(p.is_file() and p.name.lower().endswith(tuple(exts)) for p in path.rglob("*"))
        raise DataError(f"no {'/'.join(exts)} files under '{path}'"
                        + (" (hidden files and __MACOSX/ are passed over)" if hidden else ""))

    def named(split: str) -> list[Path]:
        return [f for f in files if _named_as(f, path, (split,))]

    if eval_split:
        eval_files = named(eval_split)
        if not eval_files:
            raise DataError(f"no file under '{path}' has data.eval_split '{eval_split}' in its name")
    else:
        eval_files = next((found for name in EVAL_SPLIT_NAMES if name != train_split and (found := named(name))), [])
    others = [name for name in EVAL_SPLIT_NAMES if name != train_split]
    train_files = [f for f in named(train_split) if f not in eval_files]
    # A file named as both (train.test.txt) is not trained on; words of a folder every training file is under
    # (test_run/train.txt) name no split.
    shared = (train_files[0].parent if len(train_files) == 1 else Path(os.path.commonpath(train_files)) if train_files
              else path)
    train_files = [f for f in train_files if not _named_as(f, shared, others)]
    if named_split and not train_files:
        raise DataError(f"no file under '{path}' has data.train_split '{train_split}' in its name"
                        + (" (besides the held-out ones)" if named(train_split) else ""))
    # Every file not held out, but those named as another held-out split: a test set is never trained on.
    train_files = train_files or [f for f in files if f not in eval_files and not _named_as(f, path, others)]
    if not train_files:
        raise DataError(f"no training files under '{path}' (every file looks like an eval split)")
    return train_files, eval_files or None


def data_files(folder: Path, exts: Sequence[str]) -> list[Path]:
    """The files of `folder` (and below) ending in one of `exts`, hidden ones and __MACOSX/ passed over."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(tuple(exts))
                  and not any(skipped(part) for part in p.relative_to(folder).parts))


def _named_as(file: Path, folder: Path, splits: Sequence[str]) -> bool:
    """Whether one of `splits` is a word of the file's path in `folder`."""
    # As words of the path: 'latest.txt' holds no test split, nor 'medieval.txt' an eval one.
    words = _words(str(file.relative_to(folder)))
    return any(_holds(words, _words(split)) for split in splits)


def _words(name: str) -> list[str]:
    """The letter and digit runs of a name, in lower case: `newstest2014.de` is newstest, 2014, de."""
    return re.findall(r"[a-z]+|[0-9]+", name.lower())


def held_out_files(data: Data) -> str | None:
    """Which files of a folder its split by name held out, in words for the run's data line (None: not a folder)."""
    if data.source not in SOURCE_FILES or not data.path or not Path(data.path).is_dir():
        return None
    folder = Path(data.path)
    train, held = split_files(folder, SOURCE_FILES[data.source], data)
    unread = [f for f in data_files(folder, SOURCE_FILES[data.source]) if f not in train and f not in (held or ())]
    words = [f"from {_listed(held, folder)}"] if held else []
    other = [f for f in unread if _named_as(f, folder, EVAL_SPLIT_NAMES)]
    if other:  # held out by name, but not the split held out: a test set beside a validation set
        words.append(f"{_listed(other, folder)} not read: another held-out split, which data.eval_split may pick")
    if rest := [f for f in unread if f not in other]:
        words.append(f"{_listed(rest, folder)} not read: not named data.train_split '{data.train_split}'")
    return "; ".join(words) or None


def _listed(files: Sequence[Path], folder: Path) -> str:
    """Some files of `folder` by name, the first two and a count past three."""
    names = [str(f.relative_to(folder)) for f in files]
    return ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:2])} and {len(names) - 2} more"


def _holds(words: list[str], want: list[str]) -> bool:
    return any(words[i:i + len(want)] == want for i in range(len(words) - len(want) + 1))


def held_count(n: int, fraction: float) -> int:
    """How many of `n` records `fraction` asks to hold out (n >= 2): at least one, and one fewer than all."""
    return min(n - 1, max(1, int(round(n * fraction))))


def hold_out(n: int, fraction: float, keys: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, eval rows): a fixed random `fraction` held out, the same for every seed and rank."""
    if fraction <= 0 or n < 2:
        return np.arange(n), np.arange(0)
    k = held_count(n, fraction)
    # Keyed (an image folder's paths, a text's lines), each row's place is its key's hash: a row removed or added
    # moves at most one other between the splits, where a permutation of n would deal them all anew; and the
    # copies of a line fall on one side.
    hashes = np.fromiter((int.from_bytes(hashlib.blake2b(key.encode(errors="surrogatepass"), digest_size=8).digest(),
                                         "big") for key in keys), dtype=np.uint64, count=len(keys))
    perm = np.argsort(hashes, kind="stable") if keys else rng(0, "hold-out", n).permutation(n)
    if keys:  # the cut moves to the nearest place between two different keys: no line on both sides
        ordered = hashes[perm]
        between = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
        k = int(between[np.argmin(np.abs(between - k))]) if len(between) else 0
    return np.sort(perm[k:]), np.sort(perm[:k])


def held_none(n: int, fraction: float, unit: str, where: str) -> str | None:
    """Why `hold_out` keeps none of `where`'s `n` records (each a `unit`) back at `fraction`; None where it does."""
    if fraction <= 0 or n >= 2:  # none asked for, or at least one held out
        return None
    return (f"data.eval_fraction ({fraction:g}) holds out whole {unit}s, and {where} has {n} {unit}, which training "
            f"keeps; give it more {unit}s")


def eval_split_name(splits: Any, data: Data) -> str | None:
    """The held-out split of a DatasetDict: data.eval_split, else the first of EVAL_SPLIT_NAMES it has."""
    if data.eval_split is not None:
        return data.eval_split
    return next((name for name in EVAL_SPLIT_NAMES if name in splits and name != data.train_split), None)


def pick_splits(splits: Any, data: Data, where: str) -> tuple[Any, Any]:
    """(train, eval or None) datasets out of a DatasetDict."""
    names = ", ".join(splits.keys())
    if data.train_split not in splits:
        raise DataError(f"{where} has no split '{data.train_split}' (it has {names or 'none'}); set data.train_split")
    if data.eval_split is not None and data.eval_split not in splits:
        raise DataError(f"{where} has no split '{data.eval_split}' (it has {names}); set data.eval_split")
    held = eval_split_name(splits, data)
    return splits[data.train_split], None if held is None else splits[held]


def load_builder(builder: str, where: str, cache_dir: Path | None, **kwargs: Any) -> Any:
    """A local DatasetDict through a `datasets` packaged builder (imagefolder, parquet)."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error line would come before ours
    try:
        with progress_bars(False):  # a local read: its bars would be escape codes between the run's lines
            return datasets.load_dataset(builder, cache_dir=str(cache_dir) if cache_dir else None, **kwargs)
    except Exception as e:
        raise DataError(f"cannot read {where} as {builder}: {first_line(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


@contextlib.contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """`datasets`' progress bars shown or not within the block, as they were after it."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if shown else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def open_splits(data: Data, cache_dir: Path | None, local: str) -> tuple[Any, str]:
    """(DatasetDict, a description for messages) of a hub or parquet source; `local`: what a hub error suggests."""
    if data.source == "hub":
        assert data.name is not None
        return load_hub(data.name, data.config, cache_dir, local), f"dataset '{data.name}'"
    path = existing_path(data.path, "data.source 'parquet'")
    train, evl = split_files(path, SOURCE_FILES["parquet"], data)
    for file in [*train, *(evl or [])]:
        _check_parquet(file)
    files = {data.train_split: [str(f) for f in train]}
    if evl:
        files[data.eval_split or "validation"] = [str(f) for f in evl]
    import datasets

    # Each split on its own: read together, every split takes the first file's features (its class names, its
    # columns), so a test split whose names come in another order keeps its numbers under the training split's.
    where = f"'{path}'"
    return datasets.DatasetDict({split: load_builder("parquet", where, cache_dir, data_files={split: names})[split]
                                 for split, names in files.items()}), where


def _check_parquet(file: Path) -> None:
    """Refuse, naming it, a parquet file that cannot be read or holds no rows (the loader's error names neither)."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_metadata(file).num_rows
    except Exception as e:
        raise DataError(f"'{file}' is not a parquet file ({first_line(e)})") from None
    if rows == 0:
        raise DataError(f"'{file}' holds no rows; remove it or give data.path a folder of parquet files with data")


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Put `datasets` and `huggingface_hub` in offline mode for one call (cache only, no retries)."""
    import datasets.config as dc
    import huggingface_hub.constants as hc

    saved = (getattr(dc, "HF_HUB_OFFLINE", None), getattr(hc, "HF_HUB_OFFLINE", None))
    dc.HF_HUB_OFFLINE = True
    hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        setattr(dc, "HF_HUB_OFFLINE", saved[0])  # noqa: B010 (typed as bool, restored as read)
        setattr(hc, "HF_HUB_OFFLINE", saved[1])  # noqa: B010


def load_hub(name: str, config: str | None, cache_dir: Path | None, kind: str | None) -> Any:
    """A DatasetDict from the hub (or its local cache); DataError in one line when neither works (`kind`: the local
    source to advise instead; None: gpipe prepare-data's own download)."""
    # Bound each HTTP call; read by huggingface_hub at import, so only effective if not imported yet.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "60")
    import datasets

    label = f"'{name}'" + (f" (config '{config}')" if config else "")
    local = f"use data.source: {kind} with a local copy" if kind else \
        "run this command where there is network, and copy the folder it writes here"
    cache = str(cache_dir) if cache_dir else None
    offline_env = offline_flag()
    problem = None if offline_env else hub_problem()
    if offline_env or problem is not None:
        why = "offline mode is set (HF_HUB_OFFLINE)" if offline_env else f"no network connection ({problem})"
        try:
            with _offline():
                return datasets.load_dataset(name, config, cache_dir=cache)
        except Exception:
            made = " (gpipe prepare-data of this recipe, run where there is network, writes one as a folder to copy " \
                "here)" if kind else ""
            raise DataError(f"cannot download dataset {label} from the Hugging Face hub: {why} "
                            f"and no cached copy; {local}{made}") from None
    try:
        return datasets.load_dataset(name, config, cache_dir=cache)
    except Exception as e:
        cls = type(e).__name__
        if cls == "DatasetNotFoundError":
            msg = f"dataset {label} was not found on the Hugging Face hub (check data.name)"
        elif cls == "GatedRepoError" or "gated" in str(e).lower():
            msg = f"dataset {label} is gated: accept its terms on the hub and log in (hf auth login)"
        elif isinstance(e, (ConnectionError, TimeoutError, OSError)) and "config" not in str(e).lower():
            msg = f"cannot download dataset {label} from the Hugging Face hub ({first_line(e)}); {local}"
        else:
            msg = f"cannot load dataset {label} from the Hugging Face hub: {first_line(e)}"
        raise DataError(msg) from None


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message, for one-line errors."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
