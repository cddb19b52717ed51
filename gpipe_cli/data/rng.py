"""Random streams that are pure functions of their keys, untouched by any global RNG."""

from __future__ import annotations

import zlib

import numpy as np


def stream_id(name: str) -> int:
    """A stable integer for a stream name (Python's hash() is salted per process, crc32 is not)."""
    return zlib.crc32(name.encode("utf-8"))


def rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    """A generator determined only by (seed, stream, keys): the same on every rank and every run."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), stream_id(stream),
                                                                       *(int(k) for k in keys)])))
