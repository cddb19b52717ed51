"""Class names: an imagefolder run's export keeps them in label order, and gpipe predict prints them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from gpipe_cli.cli import run
from gpipe_cli.data.images import _open, folder_classes
from gpipe_cli.models.weights import CLASSES, class_names
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.recipe_model import model_spec
from gpipe_cli.train.export import _classes
from tests.predict.exports import write_export


def _folder(root: Path) -> Path:
    """train/<class>/*.png with classes made in an order other than their names' (c, a, b)."""
    for shade, name in ((0, "c"), (128, "a"), (250, "b")):
        folder = root / "train" / name
        folder.mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((8, 8, 3), shade + i, dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def _recipe(tmp_path: Path, folder: Path) -> Path:
    """An AmoebaNet run's recipe.yaml on the image folder."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "r", "model": {"kind": "amoebanet", "layers": 3, "filters": 4, "image_size": 32, "num_classes": 3},
        "data": {"source": "imagefolder", "path": str(folder)}}))
    return tmp_path / "recipe.yaml"


def test_the_names_are_in_the_order_the_loader_numbers_the_classes(tmp_path):
    folder = _folder(tmp_path / "images")
    recipe = load_recipe(_recipe(tmp_path, folder), check_data=False)
    splits, _ = _open(recipe.data, tmp_path / "cache")
    assert folder_classes(folder) == splits["train"].features["label"].names == ["a", "b", "c"]


def test_an_imagefolder_run_s_export_holds_its_class_names(tmp_path):
    folder = _folder(tmp_path / "images")
    recipe = load_recipe(_recipe(tmp_path, folder), check_data=False)
    assert _classes(recipe, model_spec(recipe)) == ["a", "b", "c"]
    synthetic = load_recipe(tmp_path / "recipe.yaml", ["data.source=synthetic"], check_data=False)
    assert _classes(synthetic, model_spec(synthetic)) is None  # no names: predict says class N
    moved = load_recipe(tmp_path / "recipe.yaml", [f"data.path={tmp_path / 'gone'}"], check_data=False)
    assert _classes(moved, model_spec(moved)) is None


def test_a_parquet_run_s_export_holds_the_class_names_its_files_keep(tmp_path):
    # prepare-data keeps a hub data set's class names in the parquet files; the export said class 4 for deer.
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])})
    pictures = [Image.fromarray(np.full((8, 8, 3), shade, dtype=np.uint8)) for shade in (0, 200)]
    folder = tmp_path / "data"
    folder.mkdir()
    datasets.Dataset.from_dict({"image": pictures, "label": [0, 1]}, features=features).to_parquet(
        str(folder / "train-00000-of-00001.parquet"))
    recipe = load_recipe(_recipe(tmp_path, folder), ["data.source=parquet", "model.num_classes=2"], check_data=False)
    assert _classes(recipe, model_spec(recipe)) == ["cat", "dog"]
    numbered = load_recipe(tmp_path / "recipe.yaml", ["data.source=parquet", "data.label_field=other"],
                           check_data=False)
    assert _classes(numbered, model_spec(numbered)) is None  # a column that names no classes: numbers


def _top(capsys, model: Path, image: Path) -> list[str]:
    assert run(["predict", str(model), str(image), "--top", "3"]) == 0
    path, classes = capsys.readouterr().out.rstrip("\n").split("\t")
    return [part.rsplit(" (", 1)[0] for part in classes.split(", ")]


def test_predict_prints_the_class_names_and_class_numbers_without_them(tmp_path, capsys):
    # An imagefolder run's classes a, b, c were printed "class 2 (100.0%), class 0 (0.0%), class 1 (0.0%)".
    image = _folder(tmp_path / "images") / "train" / "a" / "0.png"
    named = write_export(tmp_path, "image", **{CLASSES: json.dumps(["a", "b", "c"])})
    assert sorted(_top(capsys, named, image)) == ["a", "b", "c"]
    (tmp_path / "old").mkdir()
    old = write_export(tmp_path / "old", "image")
    assert sorted(_top(capsys, old, image)) == ["class 0", "class 1", "class 2"]
    assert class_names({CLASSES: "not json"}) == [] and class_names({CLASSES: "[1, 2]"}) == []


def test_the_names_match_the_class_numbers(tmp_path, capsys):
    image = _folder(tmp_path / "images") / "train" / "a" / "0.png"
    plain = write_export(tmp_path, "image")
    with safe_open(str(plain), framework="pt") as f:  # the same weights, with the names added
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    save_file(tensors, str(tmp_path / "named.safetensors"), metadata={**metadata, CLASSES: '["a", "b", "c"]'})
    numbers, named = _top(capsys, plain, image), _top(capsys, tmp_path / "named.safetensors", image)
    assert named == ["abc"[int(n.split()[1])] for n in numbers]  # the same weights: name i is class i


def test_the_names_the_run_trained_on_are_exported_though_the_folder_changed_since(tmp_path):
    # Renamed after training (red -> apple), the folder gave the export its new order: a red image was "blue".
    from gpipe_cli.data.images import image_splits
    from gpipe_cli.runs import CLASSES_FILE

    folder = _folder(tmp_path / "images")
    recipe = load_recipe(_recipe(tmp_path, folder), check_data=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    image_splits(recipe.data, seed=0, image_size=32, num_classes=3, cache_dir=tmp_path / "cache", run_dir=run_dir)
    assert json.loads((run_dir / CLASSES_FILE).read_text()) == ["a", "b", "c"]
    (folder / "train" / "a").rename(folder / "train" / "z")  # now b, c, z
    assert _classes(recipe, model_spec(recipe), run_dir) == ["a", "b", "c"]
    assert _classes(recipe, model_spec(recipe)) == ["b", "c", "z"]  # a run from before the names were kept
    # A resume reads the data again: the names stay those of the first start, and a class the run did not start
    # with is refused (numbered by the folder's new order, the images of 'a' trained as the third class).
    from gpipe_cli.errors import DataError

    with pytest.raises(DataError, match=r"\(resumed\) has classes that are not the classes the run started with "
                                        r"\('z'\); the model's outputs are numbered by 'a', 'b', 'c'$"):
        image_splits(recipe.data, seed=0, image_size=32, num_classes=3, cache_dir=tmp_path / "cache2",
                     run_dir=run_dir)
    assert json.loads((run_dir / CLASSES_FILE).read_text()) == ["a", "b", "c"]
    (folder / "train" / "z").rename(folder / "train" / "a")
    (folder / "train" / "c").rename(tmp_path / "c")  # a class taken away: the others keep their numbers
    train, held = image_splits(recipe.data, seed=0, image_size=32, num_classes=3, cache_dir=tmp_path / "cache3",
                               run_dir=run_dir)
    assert sorted({*train.labels.tolist(), *held.labels.tolist()}) == [0, 1]
