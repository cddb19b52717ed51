"""Small data sets that the data tests write for themselves."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from gpipe_cli.recipe.schema import Data

COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (200, 200, 30)]


def png_bytes(colour: tuple[int, int, int], size: int = 12, seed: int = 0) -> bytes:
    """A small noisy PNG of one colour."""
    noise = np.random.default_rng(seed).integers(-20, 20, (size, size, 3))
    arr = np.clip(np.array(colour)[None, None, :] + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def make_imagefolder(root: Path, classes: int = 3, per_class: int = 6, test: bool = True,
                     size: int = 12) -> Path:
    """Write root/train/<class>/*.png (and root/test/... when asked); returns root."""
    for split, n in [("train", per_class)] + ([("test", 2)] if test else []):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (d / f"{i}.png").write_bytes(png_bytes(COLOURS[c % 4], size, seed=c * 100 + i))
    return root


def pairs(n: int) -> list[tuple[str, str]]:
    """Parallel 'sentences' with a clear word-for-word mapping."""
    en = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    de = ["null", "eins", "zwei", "drei", "vier", "fuenf", "sechs", "sieben", "acht", "neun"]
    out = []
    for i in range(n):
        digits = [int(d) for d in str(i * 7919 % 10007)]
        out.append((" ".join(en[d] for d in digits), " ".join(de[d] for d in digits)))
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def data(**kw: object) -> Data:
    """A Data section with small batches unless told otherwise."""
    base: dict[str, object] = {"batch_size": 8}
    base.update(kw)
    return Data(**base)  # type: ignore[arg-type]
