"""The multi-rank test harness itself."""

import os

from tests.multiproc import results, run_ranks


def _probe() -> str | None:
    return os.environ.get("GPIPE_TEST_PROBE")


def test_ranks_see_the_callers_environment_even_after_the_server_started(monkeypatch):
    results(run_ranks(_probe, 1))  # the fork server is up from here on
    monkeypatch.setenv("GPIPE_TEST_PROBE", "set later")
    assert results(run_ranks(_probe, 2)) == ["set later", "set later"]
