"""The quick start run once for the whole session: several tests read what it printed and wrote."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class QuickStart:
    """`gpipe train` run with no arguments in an empty folder: the process and the folder it ran in."""

    proc: subprocess.CompletedProcess
    cwd: Path


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> QuickStart:
    """The built-in quick-start recipe, exactly as the README types it (200 steps: the longest run we do)."""
    cwd = tmp_path_factory.mktemp("quickstart")
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train"], capture_output=True, text=True,
                          timeout=900, cwd=cwd)
    return QuickStart(proc, cwd)
