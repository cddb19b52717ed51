"""Image augmentation: the pure-torch fallback without torchvision, deterministic by (seed, epoch, index)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from datagen import data

from gpipe_cli.data import build_data
from gpipe_cli.data.augment import ImageTransform, TorchOps, make_ops, resized_crop_params
from gpipe_cli.data.rng import rng


def test_fallback_is_used_without_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision...` raise ImportError
    assert isinstance(make_ops("auto"), TorchOps)
    with pytest.raises(ImportError):
        make_ops("torchvision")
    a = build_data(data(synthetic_size=16), "image", seed=0, image_size=32, num_classes=3)
    b = build_data(data(synthetic_size=16), "image", seed=0, image_size=32, num_classes=3)
    assert isinstance(a.train.transform.ops, TorchOps)
    for x, y in zip(a.train_batches(epoch=2), b.train_batches(epoch=2), strict=True):
        assert torch.equal(x.inputs, y.inputs)


@pytest.mark.parametrize("size", [(20, 24), (100, 140)])  # pad-and-crop and random-resized-crop policies
def test_train_transform_is_a_function_of_its_generator(size: tuple[int, int]) -> None:
    tf = ImageTransform(32, backend="torch")
    img = torch.rand(3, *size)
    out = tf(img, rng(0, "augment", 1, 7))
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    assert torch.equal(out, tf(img, rng(0, "augment", 1, 7)))
    outs = {tf(img, rng(0, "augment", e, 7)).sum().item() for e in range(6)}
    assert len(outs) > 1
    assert torch.equal(tf(img), tf(img))  # eval: no randomness


def test_pad_crop_and_flip_semantics() -> None:
    tf, ops = ImageTransform(32, backend="torch"), TorchOps()
    img = torch.rand(3, 32, 32)
    padded = ops.pad(img, 4)
    windows = [padded[:, top:top + 32, left:left + 32] for top in range(9) for left in range(9)]
    candidates = [ops.normalize(c) for w in windows for c in (w, w.flip(-1))]
    flips = 0
    for i in range(12):
        out = tf(img, rng(5, "augment", 0, i))
        matches = [k for k, c in enumerate(candidates) if torch.allclose(out, c)]
        assert matches  # a 32x32 window of the 4-pixel zero-padded image, maybe mirrored
        flips += matches[0] % 2
    assert 0 < flips < 12


def test_resized_crop_params_stay_inside() -> None:
    r = np.random.default_rng(0)
    for _ in range(200):
        h, w = int(r.integers(65, 300)), int(r.integers(65, 300))
        top, left, ch, cw = resized_crop_params(h, w, r)
        assert top >= 0 and top + ch <= h and left >= 0 and left + cw <= w and ch > 0 and cw > 0


@pytest.mark.parametrize(("h", "w", "scale", "crop"), [
    (10, 1000, (0.08, 1.0), (0, 493, 10, 13)),   # too wide for any crop of the allowed aspects: the widest, centred
    (1000, 10, (0.08, 1.0), (493, 0, 13, 10)),   # too tall: the tallest, centred
    (20, 20, (2.0, 2.0), (0, 0, 20, 20)),        # no crop of that area fits: the whole image
])
def test_a_crop_no_random_draw_fits_falls_back_to_the_centre_as_torchvision_does(h, w, scale, crop) -> None:
    assert resized_crop_params(h, w, np.random.default_rng(0), scale) == crop


def test_eval_transform_of_large_images_centre_crops() -> None:
    tf = ImageTransform(32, backend="torch")
    out = tf(torch.rand(3, 80, 120))
    assert out.shape == (3, 32, 32)
    no_aug = ImageTransform(32, augment=False, backend="torch")
    img = torch.rand(3, 80, 120)
    assert torch.equal(no_aug(img, rng(0, "augment", 0, 0)), no_aug(img))


def test_torchvision_backend_matches_the_fallback() -> None:
    pytest.importorskip("torchvision")
    img = torch.rand(3, 90, 120)
    for train in (True, False):
        outs = [ImageTransform(32, backend=b)(img, rng(0, "augment", 0, 3) if train else None)
                for b in ("torchvision", "torch")]
        assert torch.allclose(outs[0], outs[1], atol=1e-4)
