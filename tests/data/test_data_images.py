"""Local image sources: imagefolder (with and without test/) and parquet."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datagen import COLOURS, data, png_bytes

from gpipe_cli.data import DataError, build_data
from gpipe_cli.data.augment import MEAN, STD
from gpipe_cli.data.images import DatasetImages


def _build(d, cache_dir: Path, **kw):  # type: ignore[no-untyped-def]
    return build_data(d, "image", seed=0, image_size=32, num_classes=kw.pop("num_classes", 4),
                      cache_dir=cache_dir, **kw)


def test_imagefolder_with_test_split(imagefolder: Callable[..., Path], cache_dir: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    root = imagefolder(classes=3, per_class=6, test=True)
    ds = _build(data(source="imagefolder", path=str(root), batch_size=4), cache_dir)
    assert "%|" not in capfd.readouterr().err  # a local read draws no progress bars between the run's lines
    assert ds.train_size == 18 and ds.eval_size == 6 and ds.steps_per_epoch() == 4
    b = next(ds.train_batches())
    assert b.inputs.shape == (4, 3, 32, 32) and b.inputs.dtype == torch.float32
    assert b.targets.dtype == torch.int64
    labels = sorted(int(t) for e in ds.eval_batches() for t in e.targets)
    assert labels == [0, 0, 1, 1, 2, 2]
    # Eval images are the deterministic transform: class colour survives, normalised per channel.
    e = next(ds.eval_batches())
    pixel = e.inputs[0].mean((1, 2)) * torch.tensor(STD) + torch.tensor(MEAN)
    assert torch.allclose(pixel * 255, torch.tensor(COLOURS[int(e.targets[0])], dtype=torch.float32), atol=12)


def test_imagefolder_without_test_holds_out_a_fraction(imagefolder: Callable[..., Path],
                                                       cache_dir: Path) -> None:
    root = imagefolder(classes=2, per_class=10, test=False)
    d = data(source="imagefolder", path=str(root), eval_fraction=0.2, batch_size=4)
    ds = _build(d, cache_dir)
    assert ds.train_size == 16 and ds.eval_size == 4
    again = _build(d, cache_dir)
    assert [e.ids for e in ds.eval_batches()] == [e.ids for e in again.eval_batches()]
    train_rows = set(ds.train.source.rows.tolist())
    assert not train_rows & set(ds.eval.source.rows.tolist())


def test_last_stage_does_not_decode_images(imagefolder: Callable[..., Path], cache_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _build(data(source="imagefolder", path=str(imagefolder()), batch_size=4), cache_dir)
    full = list(ds.train_batches(epoch=0))

    def boom(self: DatasetImages, i: int) -> torch.Tensor:
        raise AssertionError("decoded an image")

    monkeypatch.setattr(DatasetImages, "load", boom)
    targets_only = list(ds.train_batches(epoch=0, need_inputs=False))
    assert len(targets_only) == len(full)
    assert all(b.inputs is None and torch.equal(b.targets, f.targets)
               for b, f in zip(targets_only, full, strict=True))


def test_labels_beyond_num_classes_are_an_error(imagefolder: Callable[..., Path], cache_dir: Path) -> None:
    with pytest.raises(DataError, match="num_classes"):
        _build(data(source="imagefolder", path=str(imagefolder(classes=3))), cache_dir, num_classes=2)


@pytest.mark.parametrize("layout", ["struct", "bytes"])
def test_parquet_images(tmp_path: Path, cache_dir: Path, layout: str) -> None:
    imgs = [png_bytes(COLOURS[i % 3], 40, seed=i) for i in range(12)]
    column = pa.array([{"bytes": b, "path": None} for b in imgs]) if layout == "struct" else pa.array(imgs)
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"img": column, "y": [i % 3 for i in range(12)]}), folder / "train-00000.parquet")
    pq.write_table(pa.table({"img": column.slice(0, 3), "y": [0, 1, 2]}), folder / "test-00000.parquet")
    d = data(source="parquet", path=str(folder), image_field="img", label_field="y", batch_size=4)
    ds = _build(d, cache_dir, num_classes=3)
    assert ds.train_size == 12 and ds.eval_size == 3
    b = next(ds.train_batches())
    assert b.inputs.shape == (4, 3, 32, 32)  # 40px images resized to the model's size
    single = _build(data(source="parquet", path=str(folder / "train-00000.parquet"), image_field="img",
                         label_field="y", eval_fraction=0.25), cache_dir, num_classes=3)
    assert (single.train_size, single.eval_size) == (9, 3)


def test_a_column_of_image_structs_written_without_datasets_is_found(tmp_path: Path, cache_dir: Path) -> None:
    # {bytes, path} structs written by pyarrow carry no `datasets` metadata: "no image column 'image'".
    structs = pa.array([{"bytes": png_bytes(COLOURS[i % 2], 20, seed=i), "path": None} for i in range(6)])
    pq.write_table(pa.table({"img": structs, "label": [i % 2 for i in range(6)]}), tmp_path / "raw.parquet")
    ds = _build(data(source="parquet", path=str(tmp_path / "raw.parquet"), batch_size=2, eval_fraction=0.0),
                cache_dir, num_classes=2)
    assert ds.train_size == 6 and next(ds.train_batches()).inputs.shape == (2, 3, 32, 32)


def test_parquet_missing_column_names_the_field(tmp_path: Path, cache_dir: Path) -> None:
    f = tmp_path / "x.parquet"
    pq.write_table(pa.table({"pixels": [png_bytes(COLOURS[0])], "label": [0]}), f)
    with pytest.raises(DataError, match="image_field"):
        _build(data(source="parquet", path=str(f)), cache_dir)


def test_labels_must_be_whole_numbers(tmp_path: Path, cache_dir: Path) -> None:
    imgs = pa.array([png_bytes(COLOURS[i % 3], 20, seed=i) for i in range(6)])
    whole, halves = tmp_path / "whole.parquet", tmp_path / "halves.parquet"
    pq.write_table(pa.table({"img": imgs, "y": [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]}), whole)
    pq.write_table(pa.table({"img": imgs, "y": [0.0, 1.0, 2.0, 0.5, 1.0, 2.0]}), halves)
    ds = _build(data(source="parquet", path=str(whole), image_field="img", label_field="y", batch_size=2,
                     eval_fraction=0.0), cache_dir, num_classes=3)
    assert sorted(int(y) for b in ds.train_batches() for y in b.targets) == [0, 0, 1, 1, 2, 2]
    # Cast, 0.5 would have become class 0 without a word.
    refused = r"^column 'y' of '.*halves.parquet' does not hold integer labels: 0.5 in row 3$"
    with pytest.raises(DataError, match=refused):
        _build(data(source="parquet", path=str(halves), image_field="img", label_field="y", batch_size=2),
               cache_dir, num_classes=3)
    words = tmp_path / "words.parquet"
    pq.write_table(pa.table({"img": imgs, "y": ["0", "1", "cat", "0", "1", "2"]}), words)
    with pytest.raises(DataError, match=r"does not hold integer labels: 'cat' in row 2; give class numbers from 0$"):
        _build(data(source="parquet", path=str(words), image_field="img", label_field="y", batch_size=2),
               cache_dir, num_classes=3)


def test_parquet_splits_are_each_read_with_their_own_class_names_and_columns(tmp_path: Path, cache_dir: Path) -> None:
    # Read in one call, every split took the training file's features: a test split whose ClassLabel names come
    # in another order kept its numbers under the training split's names (accuracy 0.33 for a perfect model), and
    # one with a column more was refused.
    import datasets

    names = ["red", "green", "blue"]
    features = {order: datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=order)})
                for order in (tuple(names), tuple(reversed(names)))}
    folder = tmp_path / "pq"
    folder.mkdir()
    colour = {name: COLOURS[i] for i, name in enumerate(names)}
    def rows(pairs):  # type: ignore[no-untyped-def]
        return {"image": [{"bytes": b, "path": None} for b, _ in pairs], "label": [y for _, y in pairs]}

    train = [(png_bytes(colour[names[i % 3]], 20, seed=i), i % 3) for i in range(9)]
    datasets.Dataset.from_dict(rows(train), features=features[tuple(names)]).to_parquet(folder / "train.parquet")
    test_names = list(reversed(names))  # blue, green, red
    test = [(png_bytes(colour[name], 20, seed=50 + j), test_names.index(name)) for j, name in enumerate(names * 2)]
    with_id = datasets.Features({**features[tuple(test_names)], "id": datasets.Value("int64")})
    test_file = folder / "test.parquet"
    datasets.Dataset.from_dict({**rows(test), "id": list(range(6))}, features=with_id).to_parquet(test_file)
    ds = _build(data(source="parquet", path=str(folder), batch_size=3), cache_dir, num_classes=3)
    assert ds.eval_size == 6
    labels = [int(t) for b in ds.eval_batches() for t in b.targets]
    assert labels == [0, 1, 2, 0, 1, 2]  # red, green, blue as training numbers them
