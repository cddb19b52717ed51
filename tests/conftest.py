"""Fixtures for the whole suite."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

_HF_KEYS = ("HF_HOME", "HF_DATASETS_CACHE", "TORCHINDUCTOR_CACHE_DIR")
_HF = pytest.StashKey[tuple[str, dict[str, "str | None"]]]()  # the suite's folder, and what the keys held before


def pytest_configure(config: pytest.Config) -> None:
    """Hugging Face and torch caches of the suite's own (and the commands it starts'): before anything imports them."""
    # A data set the user's cache holds is read offline: the tests of an unreachable hub then saw it found.
    folder = tempfile.mkdtemp(prefix="gpipe-tests-hf-")
    config.stash[_HF] = (folder, {key: os.environ.get(key) for key in _HF_KEYS})
    os.environ["HF_HOME"], os.environ["HF_DATASETS_CACHE"] = folder, os.path.join(folder, "datasets")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")  # an optimizer's step makes it


def pytest_unconfigure(config: pytest.Config) -> None:
    """The environment as it was, and the suite's caches gone."""
    folder, before = config.stash.get(_HF, (None, {}))
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def layer_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One cache of measured layer costs for every test (and the ranks they start), never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("layer-costs")))
        yield


@pytest.fixture(scope="session", autouse=True)
def one_thread_each() -> Iterator[None]:
    """One intra-op thread for this process and every command it starts (the launcher still shares out its ranks').

    The suite runs a process or more per core: several threads each only wait for each other on busy cores
    (a K=1 profile-memory took 10 s on two threads beside another worker, 3.6 s on one).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_interrupt_left() -> Iterator[None]:
    """A Ctrl-C remembered by one test (in this process) is not another's."""
    from gpipe_cli import interrupts

    yield
    interrupts._interrupted = interrupts._terminated = interrupts._own_term = interrupts._told = False


@pytest.fixture
def handlers() -> Iterator[None]:
    """SIGINT's and SIGTERM's handlers as they were, put back after a command that ran in this process."""
    import signal

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `-n`, keep each module on one worker (a module-scoped run is made once); long modules first, speed last."""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    # The quick-start run is shared by modules: they go together, whole.
    sharing = {module(item) for item in items if "quickstart" in getattr(item, "fixturenames", ())}
    groups = {item: "quickstart" if module(item) in sharing else module(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # Groups are handed out in this order. Those with end-to-end runs go first, so the short ones fill the
    # end evenly on both workers; a speed measurement goes last, when the other worker is soon idle.
    slow = {groups[item] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.get_closest_marker("alone") is not None, groups[item] not in slow))
