"""Image preprocessing as in the paper: random (resized) crop and horizontal flip, then normalisation."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, the usual choice for every image dataset here
STD = (0.229, 0.224, 0.225)
SMALL_IMAGE = 64  # images this small (CIFAR, SVHN, ...) get pad-and-crop instead of random resized crop
EVAL_CROP_FRACTION = 0.875  # large images: resize the shorter side to size/0.875, then centre crop

Backend = Literal["auto", "torchvision", "torch"]
Policy = Literal["auto", "pad", "resized"]


class TorchOps:
    """Pure-torch versions of the torchvision functions used (bilinear, antialiased, zero padding)."""

    def __init__(self) -> None:
        self._mean = torch.tensor(MEAN).view(3, 1, 1)
        self._std = torch.tensor(STD).view(3, 1, 1)

    def resize(self, img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        if tuple(img.shape[-2:]) == size:
            return img
        return F.interpolate(img[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]

    def crop(self, img: torch.Tensor, top: int, left: int, h: int, w: int) -> torch.Tensor:
        return img[:, top:top + h, left:left + w]

    def pad(self, img: torch.Tensor, p: int) -> torch.Tensor:
        return F.pad(img, (p, p, p, p), value=0.0)

    def hflip(self, img: torch.Tensor) -> torch.Tensor:
        return img.flip(-1)

    def normalize(self, img: torch.Tensor) -> torch.Tensor:
        return (img - self._mean) / self._std


class TorchvisionOps:
    """torchvision.transforms.v2.functional with the same arguments as TorchOps."""

    def __init__(self, tf: Any) -> None:
        self._tf = tf

    def resize(self, img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        if tuple(img.shape[-2:]) == size:
            return img
        return self._tf.resize(img, list(size), antialias=True)

    def crop(self, img: torch.Tensor, top: int, left: int, h: int, w: int) -> torch.Tensor:
        return self._tf.crop(img, top, left, h, w)

    def pad(self, img: torch.Tensor, p: int) -> torch.Tensor:
        return self._tf.pad(img, [p], fill=0.0)

    def hflip(self, img: torch.Tensor) -> torch.Tensor:
        return self._tf.horizontal_flip(img)

    def normalize(self, img: torch.Tensor) -> torch.Tensor:
        return self._tf.normalize(img, list(MEAN), list(STD))


def make_ops(backend: Backend = "auto") -> TorchOps | TorchvisionOps:
    """torchvision's functions if importable (or demanded), else the pure-torch fallback."""
    if backend == "torch":
        return TorchOps()
    try:
        import torchvision.transforms.v2.functional as tf  # optional dependency, imported lazily
    except ImportError:
        if backend == "torchvision":
            raise
        return TorchOps()
    return TorchvisionOps(tf)


def resized_crop_params(h: int, w: int, rng: np.random.Generator, scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop, torchvision's RandomResizedCrop algorithm."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    # Fallback to a central crop with the aspect ratio clamped into range.
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


# Random parameters come from the caller's generator, so a result depends only on (seed, epoch, example index);
# torchvision (when installed) or plain torch applies them with the same semantics.
class ImageTransform:
    """Float [3,h,w] image in [0,1] -> normalised [3,S,S]; random only when given a generator."""

    def __init__(self, image_size: int, *, augment: bool = True, backend: Backend = "auto") -> None:
        self.size = image_size
        self.augment = augment
        self.policy: Policy = "auto"  # pad-and-crop for small images, random resized crops for large ones
        self.ops = make_ops(backend)

    def __call__(self, img: torch.Tensor, rng: np.random.Generator | None = None) -> torch.Tensor:
        """Train transform when `rng` is given (and augmentation is on), else the eval transform."""
        s, ops = self.size, self.ops
        h, w = int(img.shape[-2]), int(img.shape[-1])
        policy = self.policy
        if policy == "auto":
            policy = "pad" if min(h, w) <= SMALL_IMAGE else "resized"
        if rng is None or not self.augment:
            if policy == "pad":
                img = ops.resize(img, (s, s))
            else:
                short = int(round(s / EVAL_CROP_FRACTION))
                # torchvision's Resize(int): the shorter side becomes `short`, the aspect ratio is kept.
                nh, nw = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
                img = ops.resize(img, (nh, nw))
                img = ops.crop(img, int(round((nh - s) / 2.0)), int(round((nw - s) / 2.0)), s, s)
            return ops.normalize(img.contiguous())
        if policy == "pad":
            # CIFAR-style: pad by 1/8 of the side (4 px at 32) and take a random crop of the original size.
            img = ops.resize(img, (s, s))
            p = max(1, s // 8)
            top, left = int(rng.integers(0, 2 * p + 1)), int(rng.integers(0, 2 * p + 1))
            img = ops.crop(ops.pad(img, p), top, left, s, s)
        else:
            top, left, ch, cw = resized_crop_params(h, w, rng)
            img = ops.resize(ops.crop(img, top, left, ch, cw), (s, s))
        if rng.random() < 0.5:
            img = ops.hflip(img)
        return ops.normalize(img.contiguous())


class FloatRange(ValueError):
    """A float image whose values are not in [0, 1]: no scale to read it by can be assumed."""


def pil_to_tensor(image: Any) -> torch.Tensor:
    """A PIL image (any mode) as float [3,h,w] in [0,1], upright as its EXIF orientation says."""
    from PIL import ImageOps

    image = ImageOps.exif_transpose(image)  # a phone's photo is stored sideways with a tag saying so
    if image.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit grey: to RGB, PIL clips it at 255 (white)
        grey = torch.from_numpy(np.asarray(image, dtype=np.float32) / 65535.0).clamp_(0.0, 1.0)
        return grey.expand(3, *grey.shape).contiguous()
    if image.mode == "F":  # 32-bit float: to RGB, PIL rounds [0, 1] to 0 or 1 of 255 (black)
        grey = torch.from_numpy(np.asarray(image, dtype=np.float32).copy())
        if grey.numel() and not (grey.isfinite().all() and grey.min() >= 0.0 and grey.max() <= 1.0):
            raise FloatRange(f"a 32-bit float image is read as values in [0, 1]; this one holds values from "
                             f"{grey.min().item():g} to {grey.max().item():g}")
        return grey.expand(3, *grey.shape).contiguous()
    if image.mode == "P" and "transparency" in image.info:  # as RGBA first: PIL warns of a direct conversion
        image = image.convert("RGBA")
    if image.mode != "RGB":
        image = image.convert("RGB")
    arr = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)
