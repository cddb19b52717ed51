"""Fixtures for the data tests: a private `datasets` cache and a tmp image folder factory."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# The tests import their helpers as `datagen`, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))
from datagen import make_imagefolder  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A `datasets` cache private to the test."""
    return tmp_path / "hf-cache"


@pytest.fixture
def imagefolder(tmp_path: Path) -> Callable[..., Path]:
    """A factory writing tmp/images/train/<class>/*.png (and test/ unless test=False)."""

    def make(**kw: object) -> Path:
        return make_imagefolder(tmp_path / "images", **kw)  # type: ignore[arg-type]

    return make
