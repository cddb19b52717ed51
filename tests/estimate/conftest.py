"""Fixtures of the estimate tests."""

import pytest

from gpipe_cli.estimate import cost_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, not yet made."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(cost_cache.CACHE_ENV, str(folder))
    return folder
