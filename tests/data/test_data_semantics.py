"""What a training run sees of its data: every example once, fresh mixes, the stated transforms, held-out apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from datagen import data, png_bytes

from gpipe_cli.data import build_data
from gpipe_cli.data.augment import ImageTransform, TorchOps
from gpipe_cli.data.image_folder import scan
from gpipe_cli.data.images import ImageExamples
from gpipe_cli.data.loader import Examples, Loader
from gpipe_cli.data.synthetic import SyntheticImages
from gpipe_cli.data.text import read_records


class _Ids(Examples):
    """n examples that are only their ids (and, for a token budget, their lengths)."""

    def __init__(self, n: int, lengths: np.ndarray | None = None) -> None:
        self.n, self.lengths = n, lengths

    def __len__(self) -> int:
        return self.n

    def collate(self, ids: np.ndarray, group: np.ndarray, *, epoch: int | None, need_inputs: bool,
                need_targets: bool) -> tuple[Any, torch.Tensor | None]:
        return None, None


def _loader(train: Examples, **kw: Any) -> Loader:
    args: dict[str, Any] = dict(train=train, eval=None, tokenizer=None, batch_size=4, tokens_per_batch=None,
                                drop_last=False, shuffle=True, seed=0)
    return Loader(**{**args, **kw})


@pytest.mark.parametrize("n", [1, 4, 9, 10, 17])
def test_without_drop_last_every_example_is_in_one_batch_whatever_the_remainder(n: int) -> None:
    # A last batch of one example is a batch too: in training and in evaluation.
    loader = _loader(_Ids(n), eval=_Ids(n))
    for epoch in (0, 1):
        assert sorted(i for b in loader.train_batches(epoch) for i in b.ids) == list(range(n))
    assert [i for b in loader.eval_batches() for i in b.ids] == list(range(n)) and loader.eval_steps() == -(-n // 4)
    dropped = _loader(_Ids(n), drop_last=True)
    assert dropped.steps_per_epoch() == n // 4
    assert all(b.size == 4 for b in dropped.train_batches(0))


def test_a_token_budget_mixes_examples_of_one_length_into_new_batches_each_epoch() -> None:
    # The boundaries depend only on the sorted lengths; which examples of a length share a batch is shuffled anew.
    lengths = np.array([3, 5] * 12)
    loader = _loader(_Ids(24, lengths), tokens_per_batch=12)
    epochs = [[frozenset(b.ids) for b in loader.train_batches(epoch)] for epoch in (0, 1)]
    assert set(epochs[0]) != set(epochs[1])
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(24))
        assert all(len({int(lengths[i]) for i in b}) == 1 for b in batches)


def test_images_are_normalised_by_the_imagenet_mean_and_std_of_each_rgb_channel() -> None:
    img = torch.empty(3, 32, 32)
    img[0], img[1], img[2] = 0.9, 0.5, 0.1  # red, green, blue
    out = ImageTransform(32, backend="torch")(img)
    expected = [(0.9 - 0.485) / 0.229, (0.5 - 0.456) / 0.224, (0.1 - 0.406) / 0.225]
    torch.testing.assert_close(out.mean(dim=(1, 2)), torch.tensor(expected))


@pytest.mark.parametrize(("h", "w", "resized", "top", "left"), [(80, 120, (37, 55), 2, 12), (128, 128, (37, 37), 2, 2),
                                                                (120, 80, (55, 37), 12, 2)])
def test_the_eval_transform_of_a_large_image_resizes_to_size_over_0_875_and_crops_the_centre(
        h: int, w: int, resized: tuple[int, int], top: int, left: int) -> None:
    img = torch.rand(3, h, w, generator=torch.Generator().manual_seed(0))
    ops = TorchOps()
    expected = ops.normalize(ops.resize(img, resized)[:, top:top + 32, left:left + 32].contiguous())
    torch.testing.assert_close(ImageTransform(32, backend="torch")(img), expected)


class _OneImage:
    """Every example the same picture: what differs between them is their augmentation alone."""

    def __init__(self) -> None:
        self.img = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))

    def load(self, i: int) -> torch.Tensor:
        return self.img


def test_each_example_epoch_and_seed_draws_its_own_augmentation() -> None:
    def images(seed: int, epoch: int) -> list[torch.Tensor]:
        examples = ImageExamples(_OneImage(), np.zeros(8), ImageTransform(32, backend="torch"), seed)  # type: ignore[arg-type]
        return [examples.image(i, epoch) for i in range(8)]

    first = images(0, 0)
    assert all(torch.equal(a, b) for a, b in zip(first, images(0, 0), strict=True))  # a function of its keys
    assert len({tuple(x.flatten().tolist()) for x in first}) > 2  # not one crop for a whole epoch
    assert not all(torch.equal(a, b) for a, b in zip(first, images(0, 1), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, images(1, 0), strict=True))  # the seed counts too


def test_data_augment_false_trains_on_the_eval_transform() -> None:
    ds = build_data(data(synthetic_size=16, augment=False), "image", seed=0, image_size=32, num_classes=3)
    assert all(torch.equal(ds.train.image(i, 3), ds.train.image(i, None)) for i in range(4))


def test_synthetic_held_out_images_are_none_of_the_training_images() -> None:
    ds = build_data(data(synthetic_size=40, eval_fraction=0.1), "image", seed=0, image_size=32, num_classes=4)
    train, held = ds.train.source, ds.eval.source
    assert ds.eval_size == 4
    for i in range(ds.eval_size):
        assert not any(torch.equal(held.load(i), train.load(j)) for j in range(ds.train_size))


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_synthetic_held_out_text_is_drawn_apart_from_the_training_text(task: str) -> None:
    train, held = read_records(data(synthetic_size=200, eval_fraction=0.1), task, seed=0, words=12, cache_dir=None)
    assert held is not None and len(held) == 20
    assert held != train[:20]
    assert sum(r in train for r in held) <= 10  # short number words may repeat by chance, not most of them


def test_synthetic_class_patterns_are_mirror_symmetric_so_a_flip_keeps_the_class() -> None:
    images = SyntheticImages(300, 2, 32, 0, "train")
    for label in (0, 1):
        mean = torch.stack([images.load(i) for i in range(300) if images.labels[i] == label]).mean(0)
        assert float((mean - mean.flip(-1)).abs().mean()) < 0.06


@pytest.mark.parametrize("val", ["val", "test"])
def test_classes_are_numbered_by_their_sorted_folder_names_even_where_a_split_lacks_one(tmp_path: Path,
                                                                                        val: str) -> None:
    # As torchvision's ImageFolder numbers them (case-sensitive: "Dog" before "bird"), whichever split has which.
    for split, classes in (("train", ["bird", "Dog", "cat"]), (val, ["cat", "Dog"])):
        for c in classes:
            (tmp_path / split / c).mkdir(parents=True)
            (tmp_path / split / c / "0.png").write_bytes(png_bytes((9, 9, 9)))
    folder = scan(tmp_path)
    assert folder.classes == ["Dog", "bird", "cat"]
    assert folder.splits["train"][1] == [0, 1, 2]  # Dog/0.png, bird/0.png, cat/0.png
    held = "validation" if val == "val" else "test"
    assert folder.splits[held] == ([f"{val}/Dog/0.png", f"{val}/cat/0.png"], [0, 2])
