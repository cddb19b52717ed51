"""Tests marked `gpu` need a CUDA GPU: without one they are skipped, saying so."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's `gpu` tests when torch sees no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"no CUDA GPU visible to torch {torch.__version__}: the GPU acceptance "
                                   f"(scripts/gpu-acceptance.sh) runs these on a machine with one")
    for item in items:
        if item.get_closest_marker("gpu") is not None and "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)
