"""Learnable synthetic data fixed by the seed: class patterns, number translation, structured text."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpipe_cli.data.rng import rng

_PATTERN_CELLS = 4  # each class is a 4x4 colour pattern, upsampled: survives crops of 1/8 of the side


class SyntheticImages:
    """Class-dependent colour patterns plus per-example noise, generated on demand at `image_size`."""

    def __init__(self, n: int, num_classes: int, image_size: int, seed: int, split: str) -> None:
        self.size = image_size
        self.seed = seed
        self.split = split
        self.labels = rng(seed, f"synthetic-image-labels-{split}").integers(0, num_classes, n)
        # Patterns are shared by the splits (same class, same look); mirror-symmetric so flips keep them.
        p = rng(seed, "synthetic-image-patterns").uniform(0.1, 0.9, (num_classes, 3, _PATTERN_CELLS,
                                                                     _PATTERN_CELLS))
        self._patterns = torch.from_numpy(((p + p[..., ::-1]) / 2).astype(np.float32))

    def load(self, i: int) -> torch.Tensor:
        """Image i as float [3,S,S] in [0,1]."""
        s = self.size
        base = F.interpolate(self._patterns[int(self.labels[i])][None], size=(s, s), mode="bilinear",
                             align_corners=False)[0]
        noise = rng(self.seed, f"synthetic-image-noise-{self.split}", i).normal(0.0, 0.15, (3, s, s))
        return (base + torch.from_numpy(noise.astype(np.float32))).clamp_(0.0, 1.0)


_EN_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_FR_UNITS = ("zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix", "onze",
             "douze", "treize", "quatorze", "quinze", "seize")
_FR_TENS = ("", "", "vingt", "trente", "quarante", "cinquante", "soixante")


def english(n: int) -> str:
    """English words for 0 <= n < 1,000,000 ("three hundred forty-two")."""
    if n < 20:
        return _EN_ONES[n]
    if n < 100:
        t, u = divmod(n, 10)
        return _EN_TENS[t] + (f"-{_EN_ONES[u]}" if u else "")
    if n < 1000:
        h, r = divmod(n, 100)
        return f"{_EN_ONES[h]} hundred" + (f" {english(r)}" if r else "")
    k, r = divmod(n, 1000)
    return f"{english(k)} thousand" + (f" {english(r)}" if r else "")


def _fr_below_100(n: int, final: bool) -> str:
    if n < 17:
        return _FR_UNITS[n]
    if n < 20:
        return f"dix-{_FR_UNITS[n - 10]}"
    if n < 70:
        t, u = divmod(n, 10)
        return _FR_TENS[t] + ("" if u == 0 else " et un" if u == 1 else f"-{_FR_UNITS[u]}")
    if n < 80:
        return "soixante et onze" if n == 71 else f"soixante-{_fr_below_100(n - 60, final)}"
    if n == 80:
        return "quatre-vingts" if final else "quatre-vingt"
    return f"quatre-vingt-{_fr_below_100(n - 80, final)}"


def _fr_below_1000(n: int, final: bool) -> str:
    h, r = divmod(n, 100)
    if h == 0:
        return _fr_below_100(r, final)
    head = "cent" if h == 1 else f"{_FR_UNITS[h]} cent" + ("s" if r == 0 and final else "")
    return head if r == 0 else f"{head} {_fr_below_100(r, final)}"


def french(n: int) -> str:
    """French words for 0 <= n < 1,000,000 ("trois cent quarante-deux", "quatre-vingts", "deux cents")."""
    if n < 1000:
        return _fr_below_1000(n, True)
    k, r = divmod(n, 1000)
    head = "mille" if k == 1 else f"{_fr_below_1000(k, False)} mille"
    return head if r == 0 else f"{head} {_fr_below_1000(r, True)}"


def _number(r: np.random.Generator) -> int:
    """Mostly small numbers (quick to learn), some up to 9999 (longer sequences)."""
    top = int(r.choice([100, 1000, 10000], p=[0.5, 0.3, 0.2]))
    return int(r.integers(0, top))


def translation_pairs(n: int, seed: int, split: str) -> list[tuple[str, str]]:
    """(English, French) words of one or two random numbers: "forty-two , seven" -> "quarante-deux , sept"."""
    r = rng(seed, f"synthetic-translation-{split}")
    pairs = []
    for _ in range(n):
        nums = [_number(r) for _ in range(1 if r.random() < 0.6 else 2)]
        pairs.append((" , ".join(english(x) for x in nums), " , ".join(french(x) for x in nums)))
    return pairs


_NOUNS = ("fox", "owl", "cat", "dog", "bear", "frog", "hare", "wolf", "duck", "goat", "lion", "mole", "crow",
          "seal", "deer", "swan")
_COLOURS = ("red", "blue", "green", "brown", "grey", "black", "white", "yellow")


def lm_documents(n: int, seed: int, split: str, words: int) -> list[str]:
    """Documents of about `words` words: counting runs, fixed facts and small sums (all predictable)."""
    world = rng(seed, "synthetic-lm-world")
    colour = {noun: _COLOURS[int(world.integers(len(_COLOURS)))] for noun in _NOUNS}
    friend = {noun: _NOUNS[int(world.integers(len(_NOUNS)))] for noun in _NOUNS}
    r = rng(seed, f"synthetic-lm-{split}")
    docs = []
    for _ in range(n):
        out: list[str] = []
        while len(out) < words:
            kind = r.random()
            if kind < 0.4:
                start, k = int(r.integers(1, 90)), int(r.integers(3, 8))
                out += ["count", "from", english(start), ":", *(english(start + j) for j in range(k)), "."]
            elif kind < 0.7:
                noun = _NOUNS[int(r.integers(len(_NOUNS)))]
                out += (["the", noun, "is", colour[noun], "."] if r.random() < 0.5
                        else ["the", noun, "likes", "the", friend[noun], "."])
            else:
                a, b = int(r.integers(0, 10)), int(r.integers(0, 10))
                out += [english(a), "plus", english(b), "is", english(a + b), "."]
        docs.append(" ".join(out))
    return docs
