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


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `-n`, keep each module on one worker (a module-scoped run is made once) and measure speed last."""
    for item in items:
        # The quick-start run is shared by modules: they go together.
        group = "quickstart" if "quickstart" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # Collected last, handed out last: by then the other worker is on its final tests and soon idle.
    items.sort(key=lambda item: item.get_closest_marker("alone") is not None)
