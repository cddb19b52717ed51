"""`gpipe profile-memory` exactly as a user types it: the five rows of the paper's Table 1, each sourced."""

import os
import subprocess
import sys

import pytest

ROWS = ("naive-1", "pipeline-1", "pipeline-2", "pipeline-4", "pipeline-8")


@pytest.mark.slow
def test_profile_memory_verbatim_gives_the_five_rows(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "profile-memory"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "COLUMNS": "200"}, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    plan, measured = out.index("estimate: about"), out.index("measuring naive-1")
    assert plan < measured
    table = out[out.index("Memory per scenario"):]
    header = next(line for line in table.splitlines() if "naive-1" in line)
    assert [name for name in ROWS if name in header] == list(ROWS)
    sources = next(line for line in table.splitlines() if "figures" in line)
    assert sources.count("measured") + sources.count("extrapolated") == len(ROWS)
