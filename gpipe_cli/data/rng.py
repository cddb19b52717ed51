"""Random streams that are pure functions of their keys, untouched by any global RNG."""

from __future__ import annotations

import zlib

import numpy as np


def rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    """A generator determined only by (seed, stream, keys): the same on every rank and every run."""
    stream_id = zlib.crc32(stream.encode("utf-8"))  # Python's hash() is salted per process, crc32 is not
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), stream_id, *map(int, keys)])))
