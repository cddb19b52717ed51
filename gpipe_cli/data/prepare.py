"""`gpipe prepare-data`: save a recipe's hub dataset once as local parquet files for machines without network."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpipe_cli import interrupts
from gpipe_cli.data.sources import eval_split_name, first_line, load_hub, pick_splits, progress_bars
from gpipe_cli.errors import DataError
from gpipe_cli.files import check_path, check_writable, hidden_prefix, make_folders, umask
from gpipe_cli.progress import note
from gpipe_cli.recipe.schema import Data

SHARD_BYTES = 512 * 2**20  # parquet files of about this size: large splits stay readable piece by piece


def _new_folder(output: Path) -> Path:
    """--output as a path, refused unless it is new or an empty folder."""
    output = Path(output).expanduser()
    check_path(output, "--output")
    if output.exists() and not output.is_dir():
        raise DataError(f"--output: '{output}' is a file; name a new folder")
    if output.exists() and any(output.iterdir()):
        raise DataError(f"--output: '{output}' already exists and is not an empty folder; choose a new folder")
    return output


def _embedded(ds: Any) -> Any:
    """The dataset with images and audio stored as bytes, not as paths into a download cache."""
    import datasets
    from datasets.table import embed_table_storage

    if not any(isinstance(f, datasets.Image | datasets.Audio) for f in ds.features.values()):
        return ds
    return ds.with_format("arrow").map(embed_table_storage, batched=True, keep_in_memory=True,
                                       desc="embedding files").with_format(None)


def save_splits(splits: Any, data: Data, output: Path, say: Callable[[str], None] | None = None) -> list[Path]:
    """Write the recipe's training and eval splits of a DatasetDict as parquet shards into a new folder."""
    output = _new_folder(output)
    train, evl = pick_splits(splits, data, f"dataset '{data.name}'")
    eval_name = eval_split_name(splits, data)
    chosen = [(data.train_split, train), *([(eval_name, evl)] if evl is not None and eval_name else [])]
    make_folders(output.parent)
    # Written next to the destination and renamed at the end: an interrupted run leaves no half folder.
    staging = Path(tempfile.mkdtemp(prefix=hidden_prefix(output), dir=output.parent))
    try:
        staging.chmod(0o777 & ~umask())  # mkdtemp's 700 would keep the folder from those it is prepared for
        for split, ds in chosen:
            shards = max(1, math.ceil(ds.data.nbytes / SHARD_BYTES))
            for i in range(shards):
                if say is not None:
                    say(f"writing {split} shard {i + 1} of {shards} ({len(ds):,} examples in {split})")
                with progress_bars(False):  # the line above says what is written: bars would only repeat it
                    part = _embedded(ds.shard(num_shards=shards, index=i, contiguous=True))
                    with interrupts.deferred():  # a Ctrl-C stops the command once this shard is written
                        part.to_parquet(str(staging / f"{split}-{i:05d}-of-{shards:05d}.parquet"))
        interrupts.check()  # one that a library swallowed on the way
        if output.exists():
            output.rmdir()
        staging.rename(output)
    except BaseException as e:  # Ctrl-C included: nothing half-written stays behind
        shutil.rmtree(staging, ignore_errors=True)
        # A closed output (`| head`) ends the command as it ends every other, with 141.
        if isinstance(e, Exception) and not isinstance(e, DataError | BrokenPipeError):
            raise DataError(f"cannot write '{output}': {first_line(e)}") from None
        raise
    return sorted(output.glob("*.parquet"))


def prepare_data(data: Data, output: Path, cache_dir: Path | None = None,
                 say: Callable[[str], None] | None = None) -> list[Path]:
    """Download the recipe's hub dataset (data.name, data.config) and save it with `save_splits`."""
    started = time.time()
    say = say or (lambda text: print(note(started, text), flush=True))
    if data.source != "hub" or not data.name:  # data.name alone would download a dataset the recipe does not read
        raise DataError(f"prepare-data saves a recipe's Hugging Face hub dataset, and this recipe reads data.source "
                        f"'{data.source}', which needs no download; for a hub dataset set data.source=hub and "
                        f"data.name (and data.config)")
    output = _new_folder(output)  # before a long download
    check_writable(output, "--output")
    say(f"downloading {data.name}{f' ({data.config})' if data.config else ''} from the Hugging Face hub "
        f"(or reading it from the local cache)")
    with progress_bars(sys.stderr.isatty()):  # in a log file a download's bars are hundreds of redrawn lines
        splits = load_hub(data.name, data.config, cache_dir, None)
    return save_splits(splits, data, output, say)
