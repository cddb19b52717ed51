"""An image folder's splits and classes come from its layout alone, and its pixels as a viewer shows them."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from datagen import COLOURS, data, png_bytes
from PIL import Image

from gpipe_cli.data import DataError, build_data
from gpipe_cli.data.augment import pil_to_tensor
from gpipe_cli.data.image_folder import scan
from gpipe_cli.data.sources import hold_out
from gpipe_cli.errors import UserError
from gpipe_cli.recipe.load import load_recipe


def _write(root: Path, layout: dict[str, int]) -> Path:
    """`layout`: a folder under `root` (with its class folder last) and how many PNGs it holds."""
    for i, (folder, n) in enumerate(layout.items()):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for j in range(n):
            (root / folder / f"{j}.png").write_bytes(png_bytes(COLOURS[i % 4], 8, seed=i * 100 + j))
    return root


def _build(root: Path, tmp_path: Path, **kw: object):  # type: ignore[no-untyped-def]
    return build_data(data(source="imagefolder", path=str(root), batch_size=2, **kw), "image", seed=0,
                      image_size=16, num_classes=4, cache_dir=tmp_path / "cache")


def test_class_folders_named_like_splits_are_classes(tmp_path: Path) -> None:
    # A class "test tube" or "val_bird" made a split of the data set reader's guess: 20 training images held out.
    root = _write(tmp_path / "images", {"train/cat": 5, "train/test tube": 5, "train/val_bird": 5})
    folder = scan(root)
    assert list(folder.splits) == ["train"] and folder.classes == ["cat", "test tube", "val_bird"]
    ds = _build(root, tmp_path, eval_fraction=0.2)
    assert ds.train_size + ds.eval_size == 15 and ds.eval_size == 3
    assert ds.eval.origin == "data.eval_fraction 0.2 of the training images"
    flat = _write(tmp_path / "flat", {"training shoe": 4, "dog": 4, "eval kit": 4})  # no split folder at all
    assert scan(flat).classes == ["dog", "eval kit", "training shoe"] and list(scan(flat).splits) == ["train"]


def test_a_class_is_the_folder_under_the_split_whatever_lies_below_it(tmp_path: Path) -> None:
    # train/cat/2023/x.png was of class "2023".
    root = _write(tmp_path / "images", {"train/cat/2023": 3, "train/cat/2024": 3, "train/dog/2023": 3,
                                        "train/dog/.thumbs": 2, "train/__MACOSX/cat": 2})
    (root / "train" / "cat" / ".DS_Store").write_bytes(b"\0")
    folder = scan(root)
    files, labels = folder.splits["train"]
    assert folder.classes == ["cat", "dog"] and labels == [0] * 6 + [1] * 3
    assert files[0] == str(Path("train/cat/2023/0.png"))


def test_split_folders_are_found_in_any_case_and_the_data_line_names_the_one_held_out(tmp_path: Path) -> None:
    # Val/ was ignored (a fraction of train/ held out instead), Validation/ beside Train/ merged into training.
    root = _write(tmp_path / "images", {"Train/a": 4, "Train/b": 4, "Val/a": 2, "Val/b": 3})
    assert set(scan(root).splits) == {"train", "validation"}
    ds = _build(root, tmp_path)
    assert (ds.train_size, ds.eval_size, ds.eval.origin) == (8, 5, "from Val/")
    assert _build(root, tmp_path, eval_split="val").eval_size == 5  # as the recipe names it, any case
    two = _write(tmp_path / "two", {"train/a": 2, "train/b": 2, "val/a": 1, "validation/a": 1})
    with pytest.raises(DataError, match=r"^'val' and 'validation' under '.*two' are both the validation split"):
        scan(two)


@pytest.mark.parametrize("layout,said", [
    ({"train/a": 2, "train/b": 2, "val": 3}, r"^3 images directly in '.*val' not in a class folder \(e\.g\. 0\.png\); "
                                             r"imagefolder wants <split>/<class>/\*\.png"),
    ({"a": 2, "b": 2, ".": 1}, r"^1 image directly in '.*images' not in a class folder"),
    ({"train/a": 2, "train/b": 2, "extra/a": 1}, r"^'.*extra' holds images but is no split beside train: move them "
                                                 r"into a split's class folders"),
])
def test_an_image_outside_a_class_folder_is_refused_in_one_line(tmp_path: Path, layout: dict[str, int],
                                                                said: str) -> None:
    # ImageNet's val/*.JPEG: "no label column 'label' (columns: image); set data.label_field".
    root = _write(tmp_path / "images", layout)
    with pytest.raises(DataError, match=said) as err:
        _build(root, tmp_path)
    assert "\n" not in str(err.value)


def test_a_file_removed_moves_at_most_one_other_between_the_splits() -> None:
    # Held out by a permutation of n, removing the file a decode error named dealt the split anew on resume.
    paths = [f"train/c{i % 3}/{i}.png" for i in range(200)]
    _, held = hold_out(200, 0.2, paths)
    _, after = hold_out(199, 0.2, paths[:57] + paths[58:])
    before = {paths[i] for i in held} - {paths[57]}
    now = {(paths[:57] + paths[58:])[i] for i in after}
    assert len(before ^ now) <= 1 and len(held) == 40


def test_an_image_that_cannot_be_decoded_is_named_by_its_file(tmp_path: Path) -> None:
    root = _write(tmp_path / "images", {"train/a": 4, "train/b": 4})
    (root / "train" / "b" / "1.png").write_bytes(png_bytes(COLOURS[0], 8)[:40])
    with pytest.raises(DataError, match=r"^cannot decode image 'train/b/1\.png' of the image folder: ") as err:
        list(_build(root, tmp_path, eval_fraction=0.0).train_batches())
    assert "\n" not in str(err.value)


def test_pixels_are_read_upright_at_their_own_depth_without_warnings(tmp_path: Path) -> None:
    grey = np.linspace(0, 255, 256).reshape(16, 16).astype(np.uint8)
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "deep.png")  # 16-bit: read as white
    deep = Image.open(tmp_path / "deep.png")
    assert deep.mode.startswith("I")
    assert torch.allclose(pil_to_tensor(deep), pil_to_tensor(Image.fromarray(grey)), atol=1e-6)
    left = np.zeros((8, 16, 3), np.uint8)
    left[:, :8] = (255, 0, 0)
    Image.fromarray(left).save(tmp_path / "upright.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise, as phones store a portrait photo
    Image.fromarray(np.ascontiguousarray(np.rot90(left))).save(tmp_path / "tagged.png", exif=exif)
    tagged, upright = (pil_to_tensor(Image.open(tmp_path / name)) for name in ("tagged.png", "upright.png"))
    assert torch.equal(tagged, upright)
    Image.fromarray(grey.astype(np.float32) / 255, mode="F").save(tmp_path / "float.tif")  # read black
    assert torch.allclose(pil_to_tensor(Image.open(tmp_path / "float.tif")), pil_to_tensor(Image.fromarray(grey)))
    Image.fromarray(grey.astype(np.float32), mode="F").save(tmp_path / "float255.tif")  # no scale to assume
    with pytest.raises(ValueError, match=r"^a 32-bit float image is read as values in \[0, 1\]; this one holds "
                                         r"values from 0 to 255$"):
        pil_to_tensor(Image.open(tmp_path / "float255.tif"))
    Image.fromarray(grey).convert("P").save(tmp_path / "palette.png", transparency=b"\0" * 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's warning of palette bytes went to the terminal mid-run
        assert pil_to_tensor(Image.open(tmp_path / "palette.png")).shape == (3, 16, 16)


def test_an_eval_split_that_is_the_training_split_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data.eval_split 'Train' is the training split: evaluation would score "
                                        r"examples trained on"):
        load_recipe(None, ["model.kind=amoebanet", "data.eval_split=Train"], check_data=False)


def test_a_split_by_another_of_its_names_is_the_training_split_too(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data.eval_split 'Training' is the training split"):
        load_recipe(None, ["model.kind=amoebanet", "data.source=imagefolder", f"data.path={tmp_path}",
                           "data.eval_split=Training"], check_data=False)
    # Elsewhere a split is its exact name: a hub data set may hold both 'training' and 'train'.
    load_recipe(None, ["model.kind=amoebanet", "data.source=hub", "data.name=x", "data.eval_split=training"],
                check_data=False)


def test_linked_folders_and_class_names_of_any_spelling_are_read_once_each(tmp_path: Path) -> None:
    import unicodedata

    root = _write(tmp_path / "images", {"train/__background__": 2, "train/caf\u00e9": 2, "val/cafe\u0301": 1,
                                        "val/__background__": 1})
    _write(tmp_path / "more", {"extra": 3})
    (root / "train" / "caf\u00e9" / "more").symlink_to(tmp_path / "more" / "extra")  # a subfolder elsewhere
    (root / "train" / "caf\u00e9" / "loop").symlink_to(root / "train")  # back up: read once, not forever
    folder = scan(root)
    assert folder.classes == ["__background__", unicodedata.normalize("NFC", "caf\u00e9")]
    files, labels = folder.splits["train"]
    assert len(files) == 2 + 2 + 3 and labels.count(1) == 5
    assert folder.splits["validation"][1] == [0, 1]


def test_an_image_beside_the_split_folders_and_a_split_not_there_are_refused(tmp_path: Path) -> None:
    root = _write(tmp_path / "images", {"train/a": 2, "train/b": 2, ".": 1})
    with pytest.raises(DataError, match=r"^1 image directly in '.*images' beside its split folders, in none of them"):
        scan(root)
    flat = _write(tmp_path / "flat", {"a": 3, "b": 3})
    with pytest.raises(DataError, match=r"^'.*flat' has no split folder 'Val' \(its splits: train; a folder without "
                                        r"split folders is all 'train'\); set data.eval_split$"):
        _build(flat, tmp_path, eval_split="Val")


def test_splits_that_number_their_classes_apart_are_numbered_as_the_training_split() -> None:
    from gpipe_cli.data.images import _renumbered

    assert _renumbered(np.array([0, 2, 1]), ["cat", "bee", "ant"], ["ant", "bee", "cat"], "w", "x").tolist() == \
        [2, 0, 1]
    with pytest.raises(DataError, match=r"^w has classes that are not x \('cow'\); the model's outputs are numbered "
                                        r"by 'ant', 'bee'$"):
        _renumbered(np.array([0]), ["cow"], ["ant", "bee"], "w", "x")


def test_a_layout_is_refused_with_the_recipe_before_any_rank_starts(tmp_path: Path) -> None:
    # Found by the ranks once started (seconds of planning and timing first); `--dry-run` passed it.
    root = _write(tmp_path / "images", {"train/a": 2, "train/b": 2, "train": 1})
    with pytest.raises(UserError, match=r": --set data.path: 1 image directly in '.*train' not in a class folder"):
        load_recipe(None, ["model.kind=amoebanet", "data.source=imagefolder", f"data.path={root}"])
