"""Image classification examples: labels up front, pixels decoded and augmented only on request."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpipe_cli.data import image_folder
from gpipe_cli.data.augment import ImageTransform, pil_to_tensor
from gpipe_cli.data.loader import Examples
from gpipe_cli.data.rng import rng
from gpipe_cli.data.sources import existing_path, first_line, hold_out, open_splits, pick_splits
from gpipe_cli.data.synthetic import SyntheticImages
from gpipe_cli.errors import DataError, shown, shown_path
from gpipe_cli.files import atomic_write_bytes
from gpipe_cli.recipe.schema import Data
from gpipe_cli.runs import CLASSES_FILE

FILE = "file"  # an image folder's column of each image's path in it: named where one cannot be decoded


class DatasetImages:
    """Images in one column of a `datasets` Dataset, restricted to some rows."""

    def __init__(self, dataset: Any, column: str, rows: np.ndarray, files: list[str] | None = None) -> None:
        self.dataset = dataset.select_columns([column])  # decoding one column leaves the others untouched
        self.column = column
        self.rows = rows
        self.files = files  # an image folder's, by row: named where one cannot be read

    def load(self, i: int) -> torch.Tensor:
        row = int(self.rows[i])
        try:
            return pil_to_tensor(self.dataset[row][self.column])
        except Exception as e:
            # PIL names the buffer it read ("<_io.BytesIO object at 0x...>"): an address, nothing a user can act on.
            why = re.sub(r" <[\w.]+ object at 0x[0-9a-f]+>", "", first_line(e))
            which = (f"{shown_path(self.files[row])} of the image folder" if self.files
                     else f"{row} of column '{self.column}'")
            raise DataError(f"cannot decode image {which}: {why}") from None


class ImageExamples(Examples):
    """Images with int labels; augmentation randomness is a function of (seed, epoch, index)."""

    def __init__(self, source: DatasetImages | SyntheticImages, labels: np.ndarray, transform: ImageTransform,
                 seed: int) -> None:
        self.source = source
        self.labels = labels.astype(np.int64)
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, i: int, epoch: int | None) -> torch.Tensor:
        """Example i, augmented for `epoch` (epoch None: the deterministic eval transform)."""
        img = self.source.load(i)
        r = None if epoch is None else rng(self.seed, "augment", epoch, i)
        return self.transform(img, r)

    def collate(self, ids: np.ndarray, group: np.ndarray, *, epoch: int | None, need_inputs: bool,
                need_targets: bool) -> tuple[Any, torch.Tensor | None]:
        targets = torch.from_numpy(self.labels[ids]) if need_targets else None
        inputs = None
        if need_inputs:
            s = self.transform.size
            inputs = (torch.stack([self.image(int(i), epoch) for i in ids]) if len(ids)
                      else torch.empty(0, 3, s, s))
        return inputs, targets


def _column(ds: Any, wanted: str, holds: Callable[[Any], bool], what: str, key: str) -> str:
    """`wanted`, or the dataset's only column whose feature `holds` such values (cifar10's images are 'img')."""
    if wanted in ds.column_names:
        return wanted
    found = [c for c, f in ds.features.items() if holds(f)]
    if len(found) == 1:
        return found[0]
    raise DataError(f"no {what} column '{wanted}' (columns: {', '.join(ds.column_names)}); set {key}")


def _integral(value: Any) -> bool:
    """Whether a label reads as an integer class number."""
    try:
        return int(value) == float(value)
    except (TypeError, ValueError, OverflowError):
        return False


def _as_images(ds: Any, data: Data, where: str) -> tuple[Any, str, np.ndarray, list[str]]:
    """(dataset with a decodable image column, its name, labels, the class names in label order if known)."""
    import datasets

    # Images as `datasets` writes them, or the {bytes, path} structs it writes them as, read without its metadata.
    col = _column(ds, data.image_field, lambda f: isinstance(f, datasets.Image) or isinstance(f, dict)
                  and set(f) == {"bytes", "path"}, "image", "data.image_field")
    lab = _column(ds, data.label_field, lambda f: isinstance(f, datasets.ClassLabel), "label", "data.label_field")
    if not isinstance(ds.features[col], datasets.Image):
        try:
            ds = ds.cast_column(col, datasets.Image())  # encoded bytes, {bytes, path} structs or file paths
        except Exception as e:
            raise DataError(f"column '{col}' of {where} does not hold images: {first_line(e)}") from None
    try:
        # Through Arrow: datasets' own NumPy formatter (before 2.21) asks NumPy 2 for a copy-free array, refused.
        raw = np.asarray(ds.with_format("arrow", columns=[lab])[lab].to_numpy())
        labels = raw.astype(np.int64)
    except Exception as e:
        values = list(ds[lab])  # as stored: name the first value that is no class number, not numpy's words
        row = next((i for i, value in enumerate(values) if not _integral(value)), None)
        found = f"{shown(values[row])} in row {row}" if row is not None else first_line(e)
        raise DataError(f"column '{lab}' of {where} does not hold integer labels: {found}; give class numbers "
                        "from 0") from None
    if raw.dtype.kind == "f" and not np.array_equal(labels, raw):  # a cast would make label 0.5 class 0
        row = int(np.flatnonzero(labels != raw)[0])
        raise DataError(f"column '{lab}' of {where} does not hold integer labels: {raw[row]:g} in row {row}")
    feature = ds.features[lab]
    return ds, col, labels, [str(n) for n in feature.names] if isinstance(feature, datasets.ClassLabel) else []


def _renumbered(labels: np.ndarray, names: list[str], into: list[str], where: str, whose: str) -> np.ndarray:
    """`labels`, numbered by class `names`, renumbered as in `into` (every one of `names` must be there)."""
    if names == into:
        return labels
    new = [name for name in names if name not in into]
    if new:
        raise DataError(f"{where} has classes that are not {whose} ({', '.join(map(repr, new[:3]))}"
                        f"{f' and {len(new) - 3} more' if len(new) > 3 else ''}); the model's outputs are numbered "
                        f"by {', '.join(map(repr, into[:5]))}{' ...' if len(into) > 5 else ''}")
    return np.array([into.index(name) for name in names], dtype=np.int64)[labels]


def _check_labels(labels: np.ndarray, classes: int | None, num_classes: int, where: str) -> None:
    if classes is not None and classes > num_classes:
        raise DataError(f"{where} has {classes} classes but model.num_classes is {num_classes}")
    if len(labels) and labels.min() < 0:
        raise DataError(f"{where} has unlabelled examples (label {labels.min()}); choose another split")
    if len(labels) and labels.max() >= num_classes:
        raise DataError(f"{where} has label {labels.max()} but model.num_classes is {num_classes}")


def parquet_classes(path: Path, field: str) -> list[str]:
    """The class names parquet files keep for their label column (as `datasets` writes them), else none."""
    import json

    import pyarrow.parquet as pq

    try:
        first = path if path.is_file() else min(path.rglob("*.parquet"), default=None)
        meta = (pq.read_schema(first).metadata or {}) if first is not None else {}
        feature = json.loads(meta.get(b"huggingface", b"{}")).get("info", {}).get("features", {}).get(field, {})
    except (OSError, ValueError, AttributeError):  # unreadable, or metadata of another shape: numbers, not names
        return []
    names = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    return [str(name) for name in names] if isinstance(names, list) else []


def folder_classes(path: Path) -> list[str]:
    """An imagefolder's class names in label order: its class folders' names, sorted."""
    return image_folder.scan(path).classes


def _scanned(data: Data) -> image_folder.Folder:
    """The image folder `data` names, with two classes at least."""
    path = existing_path(data.path, "data.source 'imagefolder'")
    if not path.is_dir():
        raise DataError(f"data.path '{path}' is not a folder ({image_folder.LAYOUT})")
    folder = image_folder.scan(path, tuple(filter(None, (data.train_split, data.eval_split))))
    if not folder.classes:
        raise DataError(f"no images under '{path}' ({image_folder.LAYOUT})")
    if len(folder.classes) == 1:
        raise DataError(f"the images under '{path}' are all in one folder ('{folder.classes[0]}'); imagefolder takes "
                        "each folder as a class and a classifier needs two at least: train/<class>/*.png")
    return folder


def _open(data: Data, cache_dir: Path | None) -> tuple[Any, str]:
    """(DatasetDict, a description for messages) of an imagefolder, parquet or hub source."""
    if data.source != "imagefolder":
        return open_splits(data, cache_dir, "imagefolder/parquet")
    import datasets

    folder = _scanned(data)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=folder.classes),
                                  FILE: datasets.Value("string")})
    # Files, not a `datasets` builder: it took splits from any word of a path ("test tube/" a test split) and
    # classes from the folder above each image (train/cat/2023/x.png of class "2023").
    splits = datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"image": [str(folder.root / f) for f in files], "label": labels,
                                          FILE: files}, features=features)
        for name, (files, labels) in folder.splits.items()})
    return splits, f"'{folder.root}'"


def image_splits(data: Data, *, seed: int, image_size: int, num_classes: int, cache_dir: Path | None = None,
                 run_dir: Path | None = None) -> tuple[ImageExamples, ImageExamples | None]:
    """(train, held-out) image examples for `data`; the class names kept in `run_dir` for export."""
    train_tf = ImageTransform(image_size, augment=data.augment)
    eval_tf = ImageTransform(image_size, augment=False)
    if data.source == "synthetic":
        tr = SyntheticImages(data.synthetic_size, num_classes, image_size, seed, "train")
        # Generated at full size: pad-and-crop keeps the pattern, a resized crop could lose it.
        train_tf.policy = eval_tf.policy = "pad"
        n_eval = int(round(data.synthetic_size * data.eval_fraction))
        ev = SyntheticImages(n_eval, num_classes, image_size, seed, "eval") if n_eval else None
        return (ImageExamples(tr, tr.labels, train_tf, seed),
                ImageExamples(ev, ev.labels, eval_tf, seed) if ev is not None else None)

    folder, given = data.source == "imagefolder", data
    if folder:  # its split folders by the names they mean: val/ or Val/ is the validation split
        data = data.model_copy(update={"train_split": image_folder.split_name(data.train_split),
                                       "eval_split": data.eval_split and image_folder.split_name(data.eval_split)})
    splits, where = _open(data, cache_dir)
    for key in ("train_split", "eval_split"):
        if folder and getattr(data, key) is not None and getattr(data, key) not in splits:
            raise DataError(f"{where} has no split folder '{getattr(given, key)}' (its splits: {', '.join(splits)}; "
                            f"a folder without split folders is all 'train'); set data.{key}")
    train_ds, eval_ds = pick_splits(splits, data, where)
    train_ds, col, labels, names = _as_images(train_ds, data, where)
    _check_labels(labels, len(names) or None, num_classes, where)
    # As trained on: an export reading the folder later (renamed, a class added) would name the classes wrongly.
    kept = run_dir / CLASSES_FILE if run_dir is not None else None
    if kept is not None and names and kept.exists():  # a resume: its outputs are numbered as the run began
        first = json.loads(kept.read_text())
        labels = _renumbered(labels, names, first, f"{where} (resumed)", "the classes the run started with")
        names = first
    elif kept is not None and names:
        atomic_write_bytes(kept, json.dumps(names).encode())
    if len(labels) == 0:
        raise DataError(f"the '{data.train_split}' split of {where} is empty")

    def examples(ds: Any, column: str, labels: np.ndarray, rows: np.ndarray, tf: ImageTransform,
                 files: list[str] | None) -> ImageExamples:
        return ImageExamples(DatasetImages(ds, column, rows, files), labels[rows], tf, seed)

    train_files = list(train_ds[FILE]) if folder else None
    if eval_ds is None:
        rows, held = hold_out(len(labels), data.eval_fraction, train_files or ())
        train = examples(train_ds, col, labels, rows, train_tf, train_files)
        if not len(held):
            return train, None
        evaluated = examples(train_ds, col, labels, held, eval_tf, train_files)
        if folder:
            evaluated.origin = f"data.eval_fraction {data.eval_fraction:g} of the training images"
            evaluated.by_content = True  # by a hash of each file's path
        return train, evaluated
    eval_ds, ecol, elabels, enames = _as_images(eval_ds, data, where)
    _check_labels(elabels, None, num_classes, f"the eval split of {where}")
    if names and enames:  # parquet files keep each split's own names: numbered alike only where they agree
        elabels = _renumbered(elabels, enames, names, f"the eval split of {where}", "the training split's")
    eval_files = list(eval_ds[FILE]) if folder else None
    evaluated = examples(eval_ds, ecol, elabels, np.arange(len(elabels)), eval_tf, eval_files)
    if eval_files:
        evaluated.origin = f"from {Path(eval_files[0]).parts[0]}/"
    return examples(train_ds, col, labels, np.arange(len(labels)), train_tf, train_files), evaluated

