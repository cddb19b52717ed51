"""Fixtures for the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def layer_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One cache of measured layer costs for every test (and the ranks they start), never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("layer-costs")))
        yield
